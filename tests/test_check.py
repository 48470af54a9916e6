"""``ray-elastic check`` on the simulated cluster: a ready cluster passes; a host with a missing
label, a slice missing a host, an unwritable bucket each come out as an error saying what to change."""

from __future__ import annotations

import uuid

import pytest
from faults import ensure_slices

from ray_elastic.cli.check import check_labels_and_slices, run_checks, tpu_hosts
from ray_elastic.sim.hosts import free_port
from ray_elastic.tpu import POD_TYPE_LABEL, SLICE_NAME_LABEL, TOPOLOGY_LABEL

SIM_CLUSTER = {"num_slices": 3}
SHARE_CLUSTER = True


@pytest.fixture
def cluster(sim_cluster):
    ensure_slices(sim_cluster, 3)
    return sim_cluster


def errors(findings) -> list[str]:
    return [f.what + " -> " + f.fix for f in findings if f.level == "error"]


def test_a_ready_cluster_passes_every_check(cluster, local_gcs):
    bucket = f"check-{uuid.uuid4().hex[:10]}"
    local_gcs.create_bucket(bucket)
    findings = run_checks(f"gs://{bucket}/run", free_port(), timeout_s=60)
    assert not errors(findings), errors(findings)
    text = "\n".join(f.what for f in findings)
    for sl in cluster.alive_slices():
        assert f"slice {sl.name}: v4-8 2x2x1, 1 host(s)" in text
    assert "writable from all 3 hosts" in text and "reachable across slices (6 connections)" in text
    assert "same versions on every host" in text


def test_an_unwritable_bucket_is_named_with_every_host(cluster, local_gcs):
    findings = run_checks(f"gs://no-such-bucket-{uuid.uuid4().hex[:8]}/run", free_port(), timeout_s=60)
    bad = [e for e in errors(findings) if "is not writable from" in e]
    assert len(bad) == 3 and all("does not exist" in e or "bucket" in e for e in bad), bad
    assert all("roles/storage.objectUser" in e for e in bad)


def test_a_host_with_a_missing_label_and_its_half_slice_are_named(cluster):
    """A node that has TPU chips and a slice name but no worker id, pod type or topology (a host
    started by hand): the check names its missing labels."""
    node = cluster._cluster.add_node(
        num_cpus=0,
        resources={"TPU": 4},
        labels={SLICE_NAME_LABEL: "hand-made"},
        dashboard_agent_listen_port=free_port(),
    )
    try:
        findings = check_labels_and_slices(tpu_hosts())
    finally:
        cluster._cluster.remove_node(node)
    (missing,) = [e for e in errors(findings) if "lacks the label" in e]
    assert "ray.io/tpu-worker-id" in missing and POD_TYPE_LABEL in missing and TOPOLOGY_LABEL in missing
    assert any("slice hand-made" in e for e in errors(findings))


def test_a_slice_short_of_a_host_and_a_misplaced_head_resource(cluster):
    """Pure check on the hosts Ray reports: a 2-host slice (v4-16) with one host, whose only host is
    worker 1 and holds no head resource."""
    from ray_elastic.cli.check import Host

    host = Host(
        "n1",
        "10.0.0.2",
        {SLICE_NAME_LABEL: "s", "ray.io/tpu-worker-id": "1", POD_TYPE_LABEL: "v4-16", TOPOLOGY_LABEL: "2x2x2"},
        {"TPU": 4},
    )
    found = errors(check_labels_and_slices([host]))
    assert any("has 1 of its 2 hosts" in e for e in found)
    assert any("worker ids [1], expected 0..0" in e for e in found)
    assert any("TPU-v4-16-head resource is on worker(s) []" in e for e in found)


def test_the_command_exits_1_and_says_what_to_change(cluster, capsys):
    from ray_elastic.cli import main

    rc = main(["check", "--address", cluster.address, "--checkpoint-dir", "/proc/not-writable/run"])
    out = capsys.readouterr().out
    assert rc == 1 and "checkpoint location /proc/not-writable/run is not writable" in out and "-> " in out
