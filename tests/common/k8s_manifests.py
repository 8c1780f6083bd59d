"""Reading the manifests of deploy/kubernetes: their documents, a pod's containers
(the daemon's, the trainer's), the configurations their command lines build, where a
container's path lies (a host path or a pod's own volume), quantities and probes."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import typer
import yaml
from torch.distributed.run import get_args_parser
from typer.testing import CliRunner

from clients.channel import ADDRESS_ENV
from core.options import command_from_config
from feeder.config import ServerConfig
from tests.common.env import ROOT
from trainer.config import TrainConfig

__all__ = ["MANIFESTS", "Doc", "containers", "daemon", "document", "documents", "env", "mount", "pod", "probe_ports",
           "quantity", "server_config", "train_config", "trainer", "uid", "volume", "where"]

MANIFESTS = ROOT / "deploy" / "kubernetes"
_QUANTITY_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
                   "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}

Doc = dict[str, Any]


def documents(name: str) -> list[Doc]:
    """The documents of manifest ``name`` (``daemonset.yaml``), empty ones left out."""
    return [doc for doc in yaml.safe_load_all((MANIFESTS / name).read_text()) if doc]


def document(name: str, kind: str) -> Doc:
    """The one document of ``kind`` in manifest ``name``."""
    (found,) = [doc for doc in documents(name) if doc["kind"] == kind]
    return found


def pod(doc: Doc) -> Doc:
    """The pod spec of a workload's template."""
    return doc["spec"]["template"]["spec"]


def containers(doc: Doc) -> list[Doc]:
    """Every container of ``doc``'s pod, init containers (native sidecars) first."""
    spec = pod(doc)
    return [*spec.get("initContainers", ()), *spec["containers"]]


def daemon(doc: Doc) -> Doc:
    """The container that runs ``feeder serve``."""
    (found,) = [c for c in containers(doc) if c.get("command") == ["feeder"] and c["args"][:1] == ["serve"]]
    return found


def trainer(doc: Doc) -> Doc:
    """The container that runs the bundled trainer under torchrun."""
    (found,) = [c for c in containers(doc) if c.get("command") == ["torchrun"]]
    return found


def _config(cls: type, args: list[str], env: dict[str, str] | None = None) -> Any:
    """``cls`` as its command line builds it from ``args`` (the daemon's or the trainer's)."""
    built: list[Any] = []
    app = typer.Typer(add_completion=False)
    app.command()(command_from_config(cls, built.append, doc=""))
    result = CliRunner().invoke(app, args, env=env)
    assert result.exit_code == 0 and built, result.output
    return built[0]


def server_config(container: Doc) -> ServerConfig:
    """The daemon's configuration, as ``feeder serve`` builds it from the container's arguments."""
    return _config(ServerConfig, container["args"][1:])


def train_config(container: Doc) -> TrainConfig:
    """The trainer's configuration, as torchrun's command line hands it its arguments."""
    parsed = get_args_parser().parse_args(container["args"])  # torchrun's own command line
    assert parsed.module and parsed.training_script == "trainer.train", container["args"]
    return _config(TrainConfig, parsed.training_script_args, env={ADDRESS_ENV: env(container)[ADDRESS_ENV]["value"]})


def env(container: Doc) -> dict[str, Doc]:
    """The container's environment entries by name."""
    return {entry["name"]: entry for entry in container.get("env", ())}


def mount(container: Doc, path: str) -> Doc:
    """The volume mount ``path`` is on (the deepest one)."""
    found = [m for m in container.get("volumeMounts", ()) if Path(path).is_relative_to(m["mountPath"])]
    assert found, f"{container['name']}: {path} is on no volume"
    return max(found, key=lambda m: len(m["mountPath"]))


def volume(doc: Doc, name: str) -> Doc:
    """The pod's volume ``name``."""
    (found,) = [v for v in pod(doc)["volumes"] if v["name"] == name]
    return found


def where(doc: Doc, container: Doc, path: str) -> tuple[str, Path]:
    """What ``path`` of ``container`` is: (the volume's place, the path inside it). A
    place is a host path, or a pod's own volume."""
    on = mount(container, path)
    source = volume(doc, on["name"])
    if "hostPath" in source:
        place = f"host{source['hostPath']['path']}"
    else:
        place = f"{doc['metadata']['name']}/{on['name']}"
    return place, Path(path).relative_to(on["mountPath"])


def uid(doc: Doc, container: Doc) -> int:
    """The user the container runs as (its own security context, else the pod's)."""
    return container.get("securityContext", {}).get("runAsUser", pod(doc)["securityContext"]["runAsUser"])


def quantity(text: str | int) -> float:
    """A Kubernetes quantity (``26Gi``, ``16``, ``500m``) as a number."""
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(text)).groups()  # type: ignore[union-attr]
    return float(number) / 1000 if unit == "m" else float(number) * _QUANTITY_UNITS[unit]


def probe_ports(container: Doc) -> list[int]:
    """The ports the container's probes ask (gRPC or TCP)."""
    probes = [container[p] for p in ("startupProbe", "readinessProbe", "livenessProbe") if p in container]
    return [probe[kind]["port"] for probe in probes for kind in ("grpc", "tcpSocket") if kind in probe]
