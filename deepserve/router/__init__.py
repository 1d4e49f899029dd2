"""`deepserve router`: one OpenAI-compatible endpoint over many replicas (see docs/deploy.md)."""
