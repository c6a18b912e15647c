"""What a process imports before its first piece of work.

Every `assay` command and every stage is a process of its own, and the suite
starts hundreds of them: a module imported where it is not used costs each of
them its load time. These tests pin down, without timing anything, which heavy
libraries each kind of start-up loads: each starts a fresh interpreter, runs
the imports that start-up runs, and reads `sys.modules`.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import subprocess
import sys

import pytest

from assay.kernel.errors import AssayError
from assay.kernel.lazy import lazy_exports

HEAVY = (
    "numpy",
    "scipy",
    "httpx",
    "asyncpg",
    "aiokafka",
    "aioboto3",
    "botocore",
    "yaml",
    "jsonschema",
    "prometheus_client",
    "pydantic",
    "assay_ingest",
    "assay_execute",
    "assay_verify",
    "assay_tournament",
    "assay_aggregate",
    "assay_decide",
)
"""Libraries that take tens to hundreds of milliseconds to import, and the stages."""

LAZY_PACKAGES = (
    "assay.bus",
    "assay.engine",
    "assay.grading",
    "assay.messages",
    "assay.runtime",
    "assay.sandbox",
    "assay.store",
    "assay.verification",
)

SERVE = """
import tempfile
from pathlib import Path

import assay.cli.distributed
import assay.runtime.distributed
from assay.runtime.bootstrap import stage_deps
from assay.runtime.embedded import discover_stages
from assay.runtime.settings import AssaySettings
from assay.store.fs_blobs import FsBlobStore

with tempfile.TemporaryDirectory() as blobs:
    wiring = stage_deps(AssaySettings.from_env(), FsBlobStore(Path(blobs)))
    discover_stages()[{stage!r}](wiring.deps)
"""
"""What `assay serve STAGE` imports and builds before it connects to anything."""


def loaded_after(code: str) -> set[str]:
    """The modules of `HEAVY` that a fresh interpreter holds after running `code`."""
    report = f"import json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    probe = f"{code}\n{report}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASSAY_")}  # the defaults
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True
    )
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_the_command_line_parser_loads_no_library() -> None:
    assert loaded_after("import assay.cli\nassay.cli._parser()") == set()


def test_the_settings_load_pydantic_and_nothing_they_only_describe() -> None:
    code = "from assay.runtime.settings import AssaySettings\nAssaySettings.from_env()"
    assert loaded_after(code) == {"pydantic"}


def test_the_statistics_commands_load_numpy_but_no_stage_store_or_client() -> None:
    code = "import assay.cli, assay.cli.grade, assay.runtime.settings"
    assert loaded_after(code) == {"numpy", "pydantic"}


def test_embedded_mode_loads_no_client_of_a_distributed_service() -> None:
    code = "import assay.cli.run, assay.runtime.embedded\nassay.runtime.embedded.discover_stages()"
    # prometheus_client: runtime/signals.py, which every stage runner counts in.
    assert loaded_after(code) == {"pydantic", "prometheus_client"}


@pytest.mark.parametrize(
    ("stage", "also"),
    [("ingest", set()), ("verify", set()), ("tournament", {"numpy"})],
)
def test_a_stage_loads_its_clients_and_itself_alone(stage: str, also: set[str]) -> None:
    clients = {"asyncpg", "aiokafka", "botocore", "prometheus_client", "pydantic"}
    assert loaded_after(SERVE.format(stage=stage)) == clients | {f"assay_{stage}"} | also


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_every_public_name_of_a_package_resolves(package: str) -> None:
    module = importlib.import_module(package)
    for name in module.__all__:
        assert getattr(module, name) is not None, name


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_no_public_name_of_a_lazy_package_is_also_a_module_of_it(package: str) -> None:
    # Importing `assay.p.x` binds `x` in the package to the module, which would then
    # shadow a function `x` that the package exports on first use.
    module = importlib.import_module(package)
    assert not {m.name for m in pkgutil.iter_modules(module.__path__)} & set(module.__all__)


def test_a_lazy_package_refuses_a_name_it_does_not_export() -> None:
    attribute = lazy_exports("assay.kernel", {"assay.kernel.errors": ["AssayError"]})
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        attribute("Nothing")
    assert attribute("AssayError") is AssayError
