"""A data directory written by an earlier Assay still folds to the state it stored.

`fixtures/demo-data-v1.tar.xz` holds the six stage stores of one `assay demo` run,
written before derived state became typed read models. Re-folding every stage's
log must reproduce each stored document exactly: a read model that renames,
drops or reshapes a field fails here, not in a user's deployment.
"""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from assay.cli.rebuild import rebuild

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "demo-data-v1.tar.xz"


@pytest.fixture(scope="module")
def earlier_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("earlier")
    with tarfile.open(FIXTURE) as archive:
        archive.extractall(root, filter="data")
    return root / "fx"


async def test_an_earlier_data_directory_folds_identically(
    earlier_data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert await rebuild(earlier_data_dir, check=True) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6
    assert all(line.endswith("identical") for line in lines), lines
