"""TensorBoard scalars written straight to gs:// (the fake-gcs-server's real GCS API), read back with
TensorBoard's own reader."""

import os
import uuid

from ray_elastic.observe.event_types import Eval
from ray_elastic.observe.tensorboard import TensorBoardWriter


def test_tensorboard_scalars_go_to_a_gcs_bucket(local_gcs, tmp_path):
    from google.cloud import storage
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    bucket = f"tb-{uuid.uuid4().hex[:8]}"
    client = storage.Client()
    client.create_bucket(bucket)
    writer = TensorBoardWriter(f"gs://{bucket}/runs/r1/tensorboard", events=[])
    for step in range(5):
        writer.on_step({"step": step, "loss": 1.0 / (step + 1), "step_time_s": 0.1, "accuracy": step / 10})
    writer.on_event(Eval(step=4, metrics={"eval/loss": 0.3}))
    writer.close()
    blobs = list(client.list_blobs(bucket, prefix="runs/r1/tensorboard/"))
    assert blobs, "nothing written to the bucket"
    for blob in blobs:
        blob.download_to_filename(str(tmp_path / blob.name.rsplit("/", 1)[-1]))
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [round(e.value, 4) for e in acc.Scalars("train/loss")] == [1.0, 0.5, 0.3333, 0.25, 0.2]
    assert round(acc.Scalars("train/accuracy")[-1].value, 4) == 0.4
    assert [(e.step, round(e.value, 4)) for e in acc.Scalars("eval/loss")] == [(4, 0.3)]


def test_a_read_only_bucket_can_be_resumed_from_but_not_checkpointed_to(local_gcs):
    """Resuming from a gs:// location only reads (the location check must not upload a probe). Credentials that may only read: a proxy in front
    of the GCS API that answers every write with 403."""
    import pytest
    from google.cloud import storage

    from ray_elastic.sim.local_gcs import FlakyEndpoint
    from ray_elastic.state.storage_locations import check_location

    bucket = f"ro-{uuid.uuid4().hex[:8]}"
    storage.Client().create_bucket(bucket)
    storage.Client().bucket(bucket).blob("run/1/commit_success.txt").upload_from_string(b"ok")
    read_only = FlakyEndpoint(local_gcs, fail_every=0, status=403, read_only=True)
    saved = {k: os.environ.get(k) for k in read_only.env}
    os.environ.update(read_only.env)
    try:
        check_location(f"gs://{bucket}/run", writable=False)  # a resume only lists
        with pytest.raises(ValueError, match="is not writable"):
            check_location(f"gs://{bucket}/run")
        assert read_only.failed.get("POST", 0) >= 1 and "GET" not in read_only.failed
    finally:
        read_only.stop()
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
