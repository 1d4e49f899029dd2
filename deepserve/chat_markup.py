"""DeepSeek's chat markup strings, in one place: the demo model's tokenizer and template write them and the
server's parsers and grammars read them.

Each is one token in DeepSeek-V3 / V3.1 / R1 tokenizers (the bars are U+FF5C, the spaces U+2581).
"""

from __future__ import annotations

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
# Tool results in the prompt (the chat template writes them; the model never does).
OUTPUTS_BEGIN = "<｜tool▁outputs▁begin｜>"
OUTPUTS_END = "<｜tool▁outputs▁end｜>"
OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
OUTPUT_END = "<｜tool▁output▁end｜>"
TOOL_MARKERS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP, OUTPUTS_BEGIN, OUTPUTS_END, OUTPUT_BEGIN,
                OUTPUT_END)

THINK, END_THINK = "<think>", "</think>"
