"""Where checkpoints may live, checked before anything is written there: a local path (shared by
every host) or ``gs://bucket/prefix``, and the environment that points GCS clients at an endpoint.
The driver checks a location before any slice is reserved (:func:`check_location`)."""

from __future__ import annotations

import os
import uuid

# Environment that points GCS clients at an endpoint (emulator, credentials, project).
# The driver forwards the ones it has to every slice process.
GCS_ENV_VARS = (
    "STORAGE_EMULATOR_HOST",
    "TENSORSTORE_GCS_HTTP_URL",
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT",
    "NO_GCE_CHECK",
    "GOOGLE_CLOUD_PROJECT",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "EPATH_USE_TF",
)


def gcs_env() -> dict[str, str]:
    """The GCS-related environment of this process, for the slice processes."""
    return {k: os.environ[k] for k in GCS_ENV_VARS if k in os.environ}


def resolve(path: str) -> str:
    """A local path as every process must read it: ``~`` expanded and made absolute on the driver (the
    slice processes' working directory is not the driver's); ``gs://`` paths as they are."""
    return path if is_gcs(path) else os.path.abspath(os.path.expanduser(path))


def is_gcs(path: str) -> bool:
    return path.startswith("gs://")


def check_location(directory: str, writable: bool = True) -> None:
    """Fail now, with what to change, if checkpoints cannot be written to ``directory`` (or, with
    ``writable=False``, read from it: a run resumes from another run's checkpoints with read access).

    For ``gs://bucket/prefix`` the bucket must exist (it is never created here) and a
    probe object must be writable; a local directory is created and probed. Nothing
    else in the directory is touched. Reading only lists the prefix.
    """
    if not isinstance(directory, str) or not directory.strip():
        raise ValueError(f"checkpoint_dir must be a local path or gs://bucket/prefix, got {directory!r}")
    if is_gcs(directory):
        _check_gcs(directory) if writable else _check_gcs_readable(directory)
    elif writable:
        _check_local(directory)


def _check_gcs_readable(directory: str) -> None:
    """Listing the prefix is all a resume needs (``roles/storage.objectViewer``)."""
    bucket_name, _, prefix = directory[len("gs://") :].partition("/")
    if not bucket_name:
        raise ValueError(f"resume_from {directory!r} has no bucket: use gs://BUCKET/PREFIX")
    from google.api_core import exceptions
    from google.cloud import storage

    try:
        list(storage.Client().list_blobs(bucket_name, prefix=prefix.strip("/") + "/", max_results=1))
    except exceptions.NotFound as e:
        raise ValueError(f"resume_from {directory!r}: bucket {bucket_name!r} does not exist") from e
    except Exception as e:
        raise ValueError(
            f"cannot read resume_from {directory!r}: {e}. Grant the training service account "
            "roles/storage.objectViewer on the bucket"
        ) from e


def _check_gcs(directory: str) -> None:
    bucket_name, _, prefix = directory[len("gs://") :].partition("/")
    if not bucket_name:
        raise ValueError(f"checkpoint_dir {directory!r} has no bucket: use gs://BUCKET/PREFIX")
    from google.cloud import storage

    try:
        client = storage.Client()
        bucket = client.lookup_bucket(bucket_name)
    except Exception as e:
        raise ValueError(
            f"cannot reach GCS for checkpoint_dir {directory!r}: {e}. Check credentials "
            "(gcloud auth application-default login, or the VM's service account) and network"
        ) from e
    if bucket is None:
        raise ValueError(
            f"checkpoint_dir {directory!r}: bucket {bucket_name!r} does not exist. Create it "
            f"(gcloud storage buckets create gs://{bucket_name} --location=<your TPU region>) "
            "or point checkpoint_dir at an existing bucket"
        )
    probe = f"{prefix.strip('/')}/.ray-elastic-probe-{uuid.uuid4().hex}".lstrip("/")
    try:
        blob = bucket.blob(probe)
        blob.upload_from_string(b"ok")
        blob.delete()
    except Exception as e:
        raise ValueError(
            f"checkpoint_dir {directory!r} is not writable: {e}. Grant the training service account "
            "roles/storage.objectAdmin on the bucket, or choose another checkpoint_dir"
        ) from e


def _check_local(directory: str) -> None:
    path = os.path.abspath(os.path.expanduser(directory))
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".ray-elastic-probe-{uuid.uuid4().hex}")
        with open(probe, "wb") as f:
            f.write(b"ok")
        os.remove(probe)
    except OSError as e:
        raise ValueError(
            f"checkpoint_dir {directory!r} is not writable ({e.strerror or e}): choose a directory every "
            "slice host can write (a shared filesystem on multi-host clusters), or a gs:// bucket"
        ) from e
