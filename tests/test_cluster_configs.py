"""The cluster configs in ``cluster/`` are valid for Ray's cluster launcher and KubeRay, and describe
the slices ray-elastic expects (checked against Ray's own validation and TPU tables)."""

import copy
import json
import os
import shlex

import pytest
import yaml

from ray_elastic import SliceSpec

CLUSTER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cluster")
HEALTH_KEYS = {"health_check_period_ms", "health_check_timeout_ms", "health_check_failure_threshold"}


def _load(name):
    with open(os.path.join(CLUSTER, name)) as f:
        return yaml.safe_load(f)


def _system_config(cmdline: str) -> dict:
    args = shlex.split(cmdline)
    for a in args:
        if a.startswith("--system-config="):
            return json.loads(a.split("=", 1)[1])
    raise AssertionError(f"no --system-config in {cmdline!r}")


def test_gce_launcher_yaml_passes_rays_own_validation():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = _load("gce-tpu.yaml")
    validate_config(prepare_config(copy.deepcopy(config)))

    tpu = config["available_node_types"]["ray_tpu_v4_16"]
    spec = SliceSpec("v4", "2x2x2")
    assert tpu["node_config"]["acceleratorType"] == spec.pod_type == "v4-16"
    assert tpu["resources"]["TPU"] == spec.chips_per_host
    assert config["max_workers"] >= 4 * spec.num_hosts
    head_cmd = " ".join(config["head_start_ray_commands"])
    sysconf = _system_config(head_cmd[head_cmd.index("ray start") :])
    assert set(sysconf) == HEALTH_KEYS and sysconf["health_check_period_ms"] <= 500
    # Autoscaler v2 retires a dead host at once (v1: a 30 s heartbeat timeout), and one round may
    # launch max(1, upscaling_speed x running) nodes of a type: all but one of 4 slices lost at once
    # are asked for in one round.
    assert "RAY_enable_autoscaler_v2=1 ray start --head" in head_cmd
    assert config["upscaling_speed"] * 1 >= 3


def test_gce_launcher_validation_catches_a_broken_config():
    # The validation above can fail: a node type without resources/node_config is rejected.
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = _load("gce-tpu.yaml")
    config["available_node_types"]["ray_tpu_v4_16"]["bogus_field"] = 1
    with pytest.raises(Exception):  # noqa: B017 - Ray's validator raises jsonschema's error, not its own
        validate_config(prepare_config(config))


def test_kuberay_manifest_has_tpu_worker_groups_and_autoscaling():
    m = _load("kuberay-tpu.yaml")
    assert m["apiVersion"] == "ray.io/v1" and m["kind"] == "RayCluster" and m["metadata"]["name"]
    spec = m["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    head = spec["headGroupSpec"]
    assert head["template"]["spec"]["containers"][0]["image"].startswith("rayproject/ray:")
    assert set(json.loads(head["rayStartParams"]["system-config"])) == HEALTH_KEYS

    # What the autoscaler tests showed matters: v2 (a dead host retired at once), not rate-limited,
    # room for replacements, pods replaced rather than restarted in place.
    assert spec["autoscalerOptions"]["version"] == "v2"
    assert spec["autoscalerOptions"]["upscalingMode"] in ("Default", "Aggressive")
    head_env = {e["name"]: e["value"] for e in head["template"]["spec"]["containers"][0]["env"]}
    assert head_env["RAY_enable_autoscaler_v2"] == "1"
    (group,) = spec["workerGroupSpecs"]
    assert group["groupName"]
    assert group["minReplicas"] <= group["replicas"] < group["maxReplicas"]
    pod = group["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    selector = pod["nodeSelector"]
    topology = selector["cloud.google.com/gke-tpu-topology"]
    assert selector["cloud.google.com/gke-tpu-accelerator"] == "tpu-v4-podslice"
    slice_spec = SliceSpec("v4", topology)  # a topology Ray's TPU tables accept
    assert group["numOfHosts"] == slice_spec.num_hosts == 2
    (container,) = pod["containers"]
    res = container["resources"]
    assert res["limits"]["google.com/tpu"] == res["requests"]["google.com/tpu"] == str(slice_spec.chips_per_host)


def _pip_installs(text: str) -> list[str]:
    return [line for line in text.splitlines() if "pip install" in line and "ray-elastic" in line]


@pytest.mark.parametrize("name", ["gce-tpu.yaml", "kuberay-tpu.yaml"])
def test_every_host_installs_this_version_and_the_dashboard_is_not_public(name):
    import ray_elastic

    with open(os.path.join(CLUSTER, name)) as f:
        text = f.read()
    installs = _pip_installs(text)
    # A replacement slice provisioned later must run the survivors' code: every install is pinned.
    assert installs and all(f"ray-elastic=={ray_elastic.__version__}" in line for line in installs), installs
    if name == "gce-tpu.yaml":
        head_cmd = " ".join(_load(name)["head_start_ray_commands"])
        assert "--dashboard-host=127.0.0.1" in head_cmd
    else:  # in a pod, 0.0.0.0 is the pod's network: allowed only with no public Service and a comment saying so
        m = _load(name)
        assert m["spec"]["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "0.0.0.0"
        assert "LoadBalancer" not in text.replace("no LoadBalancer", "") and "kind: Ingress" not in text
        assert "Do not expose the service" in text


def test_the_driver_s_resubmission_is_the_same_run_on_the_same_cluster():
    """A resubmitted RayJob must find the lost driver's keepers: same run id, the long-lived cluster
    (not a new one per attempt), resubmitted on failure; the cluster keeps its GCS in Redis."""
    job, cluster = _load("kuberay-rayjob.yaml"), _load("kuberay-tpu.yaml")
    assert job["kind"] == "RayJob" and job["spec"]["backoffLimit"] >= 1
    assert job["spec"]["clusterSelector"]["ray.io/cluster"] == cluster["metadata"]["name"]
    args = job["spec"]["entrypoint"].split()
    assert args[:2] == ["ray-elastic", "train"] and args[args.index("--run-id") + 1]
    assert cluster["spec"]["gcsFaultToleranceOptions"]["redisAddress"]
