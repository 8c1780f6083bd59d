"""deploy/kubernetes: every manifest document is valid against the Kubernetes schemas
(offline, strict), and what the manifests say runs here. Each daemon container's
command starts with its volumes on temporary folders (one per emptyDir of a pod, one
per host path, so what two containers share they share here too); its probe's port
answers gRPC health; the trainer's environment names what the loader reads, and a
loader built from it gets batches where the manifest says the daemon listens."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import kubernetes_validate
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients import FeederLoader, channel
from clients.channel import ADDRESS_ENV, TOKEN_ENV, check_address
from clients.config import LoaderConfig
from core.processes import limited
from feeder.config import is_loopback
from protos import feeder_pb2, feeder_pb2_grpc
from tests.common import k8s_manifests as k8s
from tests.common.env import ROOT, child_env
from tests.common.k8s_manifests import MANIFESTS, Doc
from tests.common.shards import build_sample_shards
from tests.common.tls import make_certificates
from tests.common.waiting import wait_for

# Native sidecars (init containers with restartPolicy: Always) are on by default from
# 1.29 and stable from 1.33.
KUBERNETES_VERSION = "1.33"
TOKEN = "k8s-test-token"
_READY = "feeder: serving on "
_START_TIMEOUT_S = 120.0  # a loaded machine imports DALI and torch slowly


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sample_shards(tmp_path_factory.mktemp("k8s-shards"))


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A folder with a short path: a unix socket's path has at most 107 bytes, and
    pytest's own folders under xdist come near that before the volume's name."""
    path = Path(tempfile.mkdtemp(prefix="k8s-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


# --- running them here -------------------------------------------------------------


def _here(tmp: Path, place_and_path: tuple[str, Path]) -> Path:
    place, inside = place_and_path
    return tmp / place.strip("/").replace("/", "_") / inside


def _fill_secrets(doc: Doc, container: Doc, tmp: Path, secrets: dict[str, dict[str, str]]) -> None:
    """Writes the files of the Secrets ``container`` mounts where they appear here."""
    for mount in container.get("volumeMounts", ()):
        secret = k8s.volume(doc, mount["name"]).get("secret")
        if secret is None:
            continue
        values = secrets[secret["secretName"]]
        items = secret.get("items") or [{"key": key, "path": key} for key in values]
        for item in items:
            target = _here(tmp, k8s.where(doc, container, f"{mount['mountPath']}/{item['path']}"))
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(values[item["key"]])


def _daemon_args_here(doc: Doc, tmp: Path, shards: Path, secrets: dict[str, dict[str, str]]) -> list[str]:
    """The daemon's arguments with each path on a volume moved to the volume's folder
    here (the dataset made of ``shards``), on ports 0."""
    daemon = k8s.daemon(doc)
    for mount in daemon["volumeMounts"]:
        _here(tmp, k8s.where(doc, daemon, mount["mountPath"])).mkdir(parents=True, exist_ok=True)
    _fill_secrets(doc, daemon, tmp, secrets)
    args = list(daemon["args"])
    for i, arg in enumerate(args):
        name, equals, path = arg.rpartition("=")
        if path.startswith("/"):
            args[i] = f"{name}{equals}{_here(tmp, k8s.where(doc, daemon, path))}"
            if args[i - 1] == "--dataset":
                shutil.copytree(shards, args[i].partition("=")[2])
    # Any free ports: the manifest's are checked against its probes and container ports.
    for option in ("--port", "--metrics-port"):
        if option in args:
            args[args.index(option) + 1] = "0"
    return args


@contextmanager
def _serving(args: list[str], log: Path) -> Iterator[int]:
    """``feeder serve`` with ``args`` (``serve`` first) as a child process; yields its
    port once it listens, and leaves no process behind."""
    with log.open("w") as output:
        daemon = subprocess.Popen(limited([sys.executable, "-m", "feeder", *args], die_with_parent=True), cwd=ROOT,
                                  env=child_env(), stdout=output, stderr=subprocess.STDOUT, text=True)

    def started() -> bool:
        return _READY in log.read_text() or daemon.poll() is not None

    try:
        assert wait_for(started, _START_TIMEOUT_S) and daemon.poll() is None, log.read_text()[-3000:]
        line = next(line for line in log.read_text().splitlines() if line.startswith(_READY))
        yield int(line.rsplit(":", 1)[1])
        daemon.terminate()
        assert daemon.wait(30) == 0, log.read_text()[-3000:]  # SIGTERM: a clean stop within --grace-s
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()


def _health(target: str, credentials: grpc.ChannelCredentials | None = None) -> int:
    channel = grpc.insecure_channel(target) if credentials is None else grpc.secure_channel(target, credentials)
    with channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30,
                                                          wait_for_ready=True)
    return reply.status


def _scrape(log: Path, token: str | None) -> int:
    """The HTTP status of a Prometheus scrape of the daemon whose output is ``log``."""
    port = re.search(r"metrics on http://\S+:(\d+)/metrics", log.read_text()).group(1)  # type: ignore[union-attr]
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    try:
        with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers),
                                    timeout=30) as reply:
            return reply.status
    except urllib.error.HTTPError as e:
        return e.code


def _secret_env(container: Doc, name: str, secrets: dict[str, dict[str, str]]) -> str:
    ref = k8s.env(container)[name]["valueFrom"]["secretKeyRef"]
    return secrets[ref["name"]][ref["key"]]


# --- the tests ---------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(MANIFESTS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_document_is_a_valid_kubernetes_object(path: Path) -> None:
    documents = k8s.documents(path.name)
    assert documents
    for doc in documents:
        assert kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION


def test_the_manifests_are_the_documented_ones() -> None:
    assert sorted(p.name for p in MANIFESTS.glob("*.yaml")) == ["cpu-pool.yaml", "daemonset.yaml",
                                                                 "train-sidecar.yaml"]


def test_a_broken_manifest_fails_validation() -> None:
    job = k8s.document("train-sidecar.yaml", "Job")
    misspelled = copy.deepcopy(job)
    daemon = k8s.pod(misspelled)["initContainers"][0]
    daemon["startupProbes"] = daemon.pop("startupProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="startupProbes"):
        kubernetes_validate.validate(misspelled, KUBERNETES_VERSION, strict=True)
    wrong_type = copy.deepcopy(job)
    k8s.pod(wrong_type)["initContainers"][0]["startupProbe"]["grpc"]["port"] = "grpc"  # a gRPC probe takes a number
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong_type, KUBERNETES_VERSION, strict=True)


def test_the_image_installs_every_package_and_runs_feeder() -> None:
    dockerfile = (MANIFESTS / "Dockerfile").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert re.search(r"^FROM python:3\.11\b", dockerfile, re.M)
    copied = set(re.findall(r"^COPY (\S+) \1$", dockerfile, re.M))
    assert set(project["tool"]["setuptools"]["packages"]) <= copied
    assert re.search(r'^RUN pip install .* "\.\[trainer\]"( |$)', dockerfile, re.M)  # the trainer runs in it too
    assert re.search(r'^ENTRYPOINT \["feeder"\]$', dockerfile, re.M)
    assert project["project"]["scripts"]["feeder"] == "cli.app:app"


@pytest.mark.parametrize("name", ["train-sidecar.yaml", "daemonset.yaml", "cpu-pool.yaml"])
def test_each_daemon_fits_its_container_and_is_probed_on_its_port(name: str) -> None:
    (doc,) = [d for d in k8s.documents(name)
              if "template" in d["spec"] and any(c.get("command") == ["feeder"] for c in k8s.containers(d))]
    daemon = k8s.daemon(doc)
    config = k8s.server_config(daemon)
    resources = daemon["resources"]
    assert k8s.quantity(resources["limits"]["memory"]) >= config.footprint_bytes  # docs/serving.md's rule
    assert k8s.quantity(resources["requests"]["cpu"]) >= config.tuning.decode_threads
    assert set(k8s.probe_ports(daemon)) == {config.port}
    assert "startupProbe" in daemon
    ports = {p["containerPort"] for p in daemon["ports"]}
    assert {config.port, config.metrics_port} <= ports
    # The kubelet probes the pod's address in plaintext: a gRPC probe needs a plaintext port on it.
    if any("grpc" in daemon[p] for p in ("startupProbe", "livenessProbe", "readinessProbe") if p in daemon):
        assert config.security.tls_cert is None and not is_loopback(config.bind)
    assert config.security.token_file is not None  # every manifest's daemon asks for the token


def _loader_config(trainer: Doc, dataset: str, monkeypatch: pytest.MonkeyPatch) -> LoaderConfig:
    """A loader's configuration in the trainer's environment: what it reads from there."""
    for name, entry in k8s.env(trainer).items():
        monkeypatch.setenv(name, entry.get("value", TOKEN))  # from a Secret: the test's token
    return LoaderConfig(dataset, address=k8s.env(trainer)[ADDRESS_ENV]["value"])


def _check_trainer_finds_daemon(doc: Doc, trainer_doc: Doc, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the trainer's container says against what the daemon's says."""
    daemon, trainer = k8s.daemon(doc), k8s.trainer(trainer_doc)
    config, train = k8s.server_config(daemon), k8s.train_config(trainer)
    read = {value for name, value in vars(channel).items() if name.endswith("_ENV")}  # what the loader reads
    assert {ADDRESS_ENV, TOKEN_ENV} <= {n for n in k8s.env(trainer) if n.startswith("FEEDER_")} <= read
    address = k8s.env(trainer)[ADDRESS_ENV]["value"]
    assert train.server == address and address == f"unix:{config.socket_path}"
    assert k8s.where(trainer_doc, trainer, str(config.socket_path)) == k8s.where(doc, daemon, str(config.socket_path))
    # The trainer's loaders look for rings where the daemon writes them, on the same volume.
    loader_shm = str(_loader_config(trainer, train.dataset, monkeypatch).shm_dir)
    assert k8s.where(trainer_doc, trainer, loader_shm) == k8s.where(doc, daemon, str(config.shm.shm_dir))
    assert k8s.mount(trainer, loader_shm)["mountPath"] == loader_shm
    token = k8s.env(trainer)[TOKEN_ENV]["valueFrom"]["secretKeyRef"]
    token_mount = k8s.mount(daemon, str(config.security.token_file))
    assert k8s.volume(doc, token_mount["name"])["secret"]["secretName"] == token["name"]
    assert config.security.token_file == Path(token_mount["mountPath"]) / token["key"]
    assert train.dataset in config.datasets
    assert k8s.uid(doc, daemon) == k8s.uid(trainer_doc, trainer)  # the socket and the segments are owner-only


def _serves_trainer(doc: Doc, trainer_doc: Doc, tmp: Path, shards: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Starts the daemon as the manifest says, asks its probe's port and the trainer's
    address for health, and takes a batch as the trainer's loader would."""
    secrets = {"feeder-token": {"token": TOKEN}}
    trainer = k8s.trainer(trainer_doc)
    with _serving(_daemon_args_here(doc, tmp, shards, secrets), tmp / "daemon.log") as port:
        assert _health(f"127.0.0.1:{port}") == health_pb2.HealthCheckResponse.SERVING
        assert (_scrape(tmp / "daemon.log", TOKEN), _scrape(tmp / "daemon.log", None)) == (200, 401)
        address = k8s.env(trainer)[ADDRESS_ENV]["value"]
        socket_here = f"unix:{_here(tmp, k8s.where(trainer_doc, trainer, address.removeprefix('unix:')))}"
        assert _health(socket_here) == health_pb2.HealthCheckResponse.SERVING
        monkeypatch.setenv(TOKEN_ENV, _secret_env(trainer, TOKEN_ENV, secrets))
        shm_here = _here(tmp, k8s.where(trainer_doc, trainer, "/dev/shm"))
        dataset = k8s.train_config(trainer).dataset
        with FeederLoader(dataset, address=socket_here, batch_size=4, image_size=32, rank=0, world_size=1,
                          shm_dir=shm_here) as loader:
            images, labels = next(iter(loader))
            assert tuple(images.shape) == (4, 3, 32, 32) and loader.transport == "shm"


@pytest.mark.slow
def test_the_sidecar_job_serves_its_trainer(shards: Path, short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = k8s.document("train-sidecar.yaml", "Job")
    sidecar = k8s.daemon(job)
    assert sidecar in k8s.pod(job)["initContainers"] and sidecar["restartPolicy"] == "Always"
    assert k8s.pod(job)["restartPolicy"] == "Never"
    dshm = k8s.volume(job, k8s.mount(sidecar, str(k8s.server_config(sidecar).shm.shm_dir))["name"])
    assert dshm["emptyDir"]["medium"] == "Memory"
    assert k8s.quantity(dshm["emptyDir"]["sizeLimit"]) >= k8s.server_config(sidecar).shm.shm_budget_bytes
    _check_trainer_finds_daemon(job, job, monkeypatch)
    _serves_trainer(job, job, short_tmp, shards, monkeypatch)


@pytest.mark.slow
def test_the_daemonset_serves_the_training_pods_of_its_node(shards: Path, short_tmp: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    daemons, job = k8s.document("daemonset.yaml", "DaemonSet"), k8s.document("daemonset.yaml", "Job")
    assert k8s.pod(job)["nodeSelector"] == k8s.pod(daemons)["nodeSelector"]
    daemon = k8s.daemon(daemons)
    shm = k8s.volume(daemons, k8s.mount(daemon, str(k8s.server_config(daemon).shm.shm_dir))["name"])
    assert shm["hostPath"]["path"] == "/dev/shm"
    _check_trainer_finds_daemon(daemons, job, monkeypatch)
    _serves_trainer(daemons, job, short_tmp, shards, monkeypatch)


@pytest.mark.slow
def test_the_cpu_pool_serves_tls_behind_its_headless_service(shards: Path, short_tmp: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    pool, service = k8s.document("cpu-pool.yaml", "Deployment"), k8s.document("cpu-pool.yaml", "Service")
    job = k8s.document("cpu-pool.yaml", "Job")
    daemon, trainer = k8s.daemon(pool), k8s.trainer(job)
    config, train = k8s.server_config(daemon), k8s.train_config(trainer)
    labels = pool["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= labels.items()
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    grpc_port = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert grpc_port["port"] == grpc_port["targetPort"] == config.port
    security = config.security
    assert security.tls_cert is not None and security.token_file is not None and not is_loopback(config.bind)

    address = k8s.env(trainer)[ADDRESS_ENV]["value"]
    check_address(address)
    assert train.server == address and train.tls_root is not None
    assert not address.startswith("dns:")  # a host name with several addresses: a pool of every daemon
    host, _, port = address.rpartition(":")
    assert int(port) == grpc_port["port"] and host.split(".")[0] == service["metadata"]["name"]
    ca_mount = k8s.mount(trainer, str(train.tls_root))
    tls_mount = k8s.mount(daemon, str(config.security.tls_cert))
    assert k8s.volume(job, ca_mount["name"])["secret"]["secretName"] == k8s.volume(pool, tls_mount["name"])["secret"][
        "secretName"]

    certs = make_certificates(short_tmp / "certs")
    secrets = {"feeder-token": {"token": TOKEN},
               "feeder-decode-tls": {"tls.crt": certs.server_cert.read_text(), "tls.key": certs.server_key.read_text(),
                                     "ca.crt": certs.ca.read_text()}}
    _fill_secrets(job, trainer, short_tmp, secrets)
    tls_root = _here(short_tmp, k8s.where(job, trainer, str(train.tls_root)))
    credentials = grpc.ssl_channel_credentials(tls_root.read_bytes())
    with _serving(_daemon_args_here(pool, short_tmp, shards, secrets), short_tmp / "daemon.log") as port_here:
        target = f"127.0.0.1:{port_here}"
        assert _health(target, credentials) == health_pb2.HealthCheckResponse.SERVING
        with grpc.secure_channel(target, credentials) as channel:
            stub = feeder_pb2_grpc.FeederStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.ListDatasets(feeder_pb2.ListDatasetsRequest(), timeout=30)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        monkeypatch.setenv(TOKEN_ENV, _secret_env(trainer, TOKEN_ENV, secrets))
        with FeederLoader(train.dataset, address=target, batch_size=4, image_size=32, rank=0, world_size=1,
                          tls_root=tls_root) as loader:
            images, labels = next(iter(loader))
            # --shm-budget-bytes 0: the pixels come inside the messages, even on this host.
            assert tuple(images.shape) == (4, 3, 32, 32) and loader.transport == "grpc"
