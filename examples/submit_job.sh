#!/usr/bin/env bash
# Run ray-elastic as a Ray job on a TPU Ray cluster (GCE TPU VMs or KubeRay on GKE).
#
#   HEAD=http://<head-ip>:8265 ./examples/submit_job.sh
#
# The cluster's image (or the runtime_env below) must have ray-elastic installed on every TPU host.
set -euo pipefail
HEAD="${HEAD:-http://127.0.0.1:8265}"

ray job submit --address "$HEAD" \
  --runtime-env-json '{"pip": ["ray-elastic"]}' \
  -- ray-elastic train \
       --example transformer \
       --accelerator v5p --topology 2x2x2 \
       --num-slices 4 --min-slices 2 --mode replica-resize \
       --global-batch 256 --steps 5000
