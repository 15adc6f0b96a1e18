"""`manage.py sync_pools`: the Helm chart's gpuPools, rendered by `helm template`, become
fleet.Pool rows; changes are audited; bad files are refused whole, naming the problem."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.core.management import CommandError, call_command

from fleet.models import Deployment, Pool
from tenants.models import AuditEvent
from tests.factories import make_model, make_tenant, make_version
from tests.onnx_models import small_onnx

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parent.parent
HELM = ROOT / ".venv" / "bin" / "helm"


def _chart_pools(*values: str) -> str:
    """The sync-pools Job's --json argument and the ConfigMap's pools.json, as rendered."""
    args = [arg for value in values for arg in ("--set", value)]
    out = subprocess.run(
        [str(HELM), "template", "rel", str(ROOT / "deploy/helm/switchyard"), *args],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    (job,) = [d for d in docs if d["metadata"]["name"] == "rel-switchyard-sync-pools"]
    (config,) = [d for d in docs if d["metadata"]["name"] == "rel-switchyard-gpu-pools"]
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:4] == ["python", "manage.py", "sync_pools", "--json"]
    assert json.loads(command[4]) == json.loads(config["data"]["pools.json"])
    return command[4]


def _sync(*args: str) -> str:
    from io import StringIO

    out = StringIO()
    call_command("sync_pools", *args, stdout=out)
    return out.getvalue()


def _events(action: str) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(action=action).order_by("id"))


def test_the_charts_pools_become_rows_and_changes_are_audited() -> None:
    text = _chart_pools(
        "gpuPools[0].name=gpu-a100",
        "gpuPools[0].nodeSelector.nvidia\\.com/gpu\\.product=A100",
        "gpuPools[0].tolerations[0].key=nvidia.com/gpu",
        "gpuPools[0].tolerations[0].operator=Exists",
        "gpuPools[1].name=gpu-l4",
        "gpuPools[1].image=registry.example.com/agent:cuda",
    )
    assert "created: gpu-a100, gpu-l4" in _sync("--json", text)
    a100 = Pool.objects.get(name="gpu-a100")
    assert (a100.backend, a100.namespace) == ("kubernetes", "default")
    assert a100.node_selector == {"nvidia.com/gpu.product": "A100"}
    assert a100.tolerations == [{"key": "nvidia.com/gpu", "operator": "Exists"}]
    assert a100.image == "ghcr.io/switchyard/switchyard-agent-cuda:0.1.0"
    assert Pool.objects.get(name="gpu-l4").image == "registry.example.com/agent:cuda"
    created = _events("pool.create")
    assert [e.target for e in created] == ["pool gpu-a100", "pool gpu-l4"]
    assert created[0].actor_label == "sync_pools command"
    assert created[0].after["node_selector"] == {"nvidia.com/gpu.product": "A100"}

    # The same file again changes nothing and writes nothing.
    assert "unchanged: gpu-a100, gpu-l4" in _sync("--json", text)
    assert len(_events("pool.create")) == 2 and not _events("pool.update")

    # An upgrade that moves a pool to other nodes updates the row, with before and after.
    text = _chart_pools(
        "gpuPools[0].name=gpu-a100",
        "gpuPools[0].nodeSelector.nvidia\\.com/gpu\\.product=H100",
    )
    out = _sync("--json", text)
    assert "updated: gpu-a100" in out
    (update,) = _events("pool.update")
    assert update.before == {
        "node_selector": {"nvidia.com/gpu.product": "A100"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
    }
    assert update.after == {"node_selector": {"nvidia.com/gpu.product": "H100"}, "tolerations": []}
    # A pool the file no longer names is kept unless pruning is asked for.
    assert Pool.objects.filter(name="gpu-l4").exists()


def test_prune_deletes_only_pools_nothing_uses(tmp_path: Path) -> None:
    tenant = make_tenant("alpha")
    used = Pool.objects.create(name="used", backend="kubernetes")
    Pool.objects.create(name="idle", backend="kubernetes")
    version = make_version(make_model(tenant, "clf"), small_onnx())
    Deployment.objects.create(tenant=tenant, version=version, pool=used)
    path = tmp_path / "pools.json"
    path.write_text(json.dumps([{"name": "cpu", "backend": "local"}]))
    out = _sync(str(path), "--prune")
    assert "created: cpu" in out and "pruned: idle" in out and "kept (in use): used" in out
    assert sorted(Pool.objects.values_list("name", flat=True)) == ["cpu", "used"]
    assert [e.target for e in _events("pool.delete")] == ["pool idle"]


BAD: list[tuple[Any, str]] = [
    ({"name": "x"}, "expected a JSON list"),
    (["x"], "pools[0]: expected an object"),
    ([{"name": "a", "backend": "local", "replicas": 3}], "unknown field(s) replicas"),
    ([{"name": "Not A Slug", "backend": "local"}], "pools[0]: name:"),
    ([{"name": "a", "backend": "ec2"}], "pools[0]: backend:"),
    ([{"name": "a", "backend": "local", "node_selector": {"k": 1}}], "node_selector"),
    ([{"name": "a", "backend": "local", "tolerations": "all"}], "tolerations"),
    ([{"name": "a", "backend": "local", "image": 5}], "pools[0].image: expected a string"),
    ([{"name": "a" * 64, "backend": "local"}], "pools[0]: name:"),
    (
        [{"name": "a", "backend": "local"}, {"name": "a", "backend": "local"}],
        "pools[1].name: 'a' appears twice",
    ),
]


@pytest.mark.parametrize(("data", "message"), BAD)
def test_a_bad_file_is_refused_whole_naming_the_problem(data: Any, message: str) -> None:
    Pool.objects.create(name="keep", backend="local")
    payload = json.dumps(data)
    with pytest.raises(CommandError) as caught:
        _sync("--json", payload, "--prune")
    assert message in str(caught.value)
    assert list(Pool.objects.values_list("name", flat=True)) == ["keep"]
    assert not AuditEvent.objects.filter(action__startswith="pool.").exists()


def test_unreadable_sources_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CommandError, match="cannot read"):
        _sync(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\xff[")
    with pytest.raises(CommandError, match="is not JSON"):
        _sync(str(bad))
    with pytest.raises(CommandError, match="--json is not JSON"):
        _sync("--json", "[{")
