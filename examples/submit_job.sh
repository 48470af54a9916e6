#!/usr/bin/env bash
# Run ray-elastic as a Ray job on a TPU Ray cluster (GCE TPU VMs or KubeRay on GKE; see cluster/).
#
#   HEAD=http://<head-ip>:8265 BUCKET=my-bucket RUN=llm-1 ./examples/submit_job.sh
#
# Submitting the same command again after the driver died resumes from the newest committed
# checkpoint in gs://$BUCKET/runs/$RUN. The event log goes to /tmp/ray-elastic/$RUN on the head:
# `ray-elastic report /tmp/ray-elastic/$RUN` draws its timeline.
# The cluster's image (or the runtime_env below) must have ray-elastic installed on every TPU host.
set -euo pipefail
HEAD="${HEAD:-http://127.0.0.1:8265}"
BUCKET="${BUCKET:?set BUCKET to an existing GCS bucket in the TPUs region}"
RUN="${RUN:-run-$(date +%Y%m%d-%H%M%S)}"

ray job submit --address "$HEAD" \
  --runtime-env-json '{"pip": ["ray-elastic"]}' \
  -- ray-elastic train \
       --example transformer \
       --accelerator v5p --topology 2x2x2 \
       --num-slices 4 --min-slices 2 --mode replica-resize \
       --global-batch 256 --steps 5000 \
       --checkpoint-dir "gs://$BUCKET/runs/$RUN" --checkpoint-every 100 \
       --run-dir "/tmp/ray-elastic/$RUN"
