"""TensorBoard scalars written straight to gs:// (the fake-gcs-server's real GCS API), read back with
TensorBoard's own reader."""

import uuid

from ray_elastic.tensorboard import TensorBoardWriter


def test_tensorboard_scalars_go_to_a_gcs_bucket(local_gcs, tmp_path):
    from google.cloud import storage
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    bucket = f"tb-{uuid.uuid4().hex[:8]}"
    client = storage.Client()
    client.create_bucket(bucket)
    writer = TensorBoardWriter(f"gs://{bucket}/runs/r1/tensorboard", events=[])
    for step in range(5):
        writer.on_step({"step": step, "loss": 1.0 / (step + 1), "step_time_s": 0.1, "accuracy": step / 10})
    writer.on_event({"kind": "eval", "step": 4, "metrics": {"eval/loss": 0.3}})
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
