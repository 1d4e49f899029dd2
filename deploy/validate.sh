#!/usr/bin/env bash
# Validate the deployment kit: render the Helm chart (defaults, every option on, the LeaderWorkerSet
# variant) and check each manifest against the Kubernetes schemas; check and unit-test the alert rules;
# check the dashboard's JSON. Needs: python with helm-python-sdk, kubernetes-validate and pyyaml; promtool.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python}"

"$PYTHON" validate_manifests.py
promtool check rules prometheus/alerts.yml
(cd prometheus && promtool test rules alerts_test.yml)
"$PYTHON" -m json.tool grafana/deepserve.json >/dev/null && echo "grafana/deepserve.json: valid JSON"
