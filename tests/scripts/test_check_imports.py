"""scripts/check_imports.py: the product's import graph runs one way, and the checker does catch
a circle, a folder cycle, an arrow back up and a torch import the api would load."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check_imports.py"


def load_checker():
    spec = importlib.util.spec_from_file_location("check_imports", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def plant(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


# A small house that obeys every rule: each package, a kiln_train folder on two floors, an api
# module that imports torch only inside a function.
CLEAN_HOUSE = {
    "kiln_train/__init__.py": "",
    "kiln_train/errors.py": "class KilnError(Exception):\n    pass\n",
    "kiln_train/ground/__init__.py": "",
    "kiln_train/ground/digest.py": "import hashlib\n\nfrom kiln_train.errors import KilnError\n",
    "kiln_train/data/__init__.py": "",
    "kiln_train/data/rows.py": "from kiln_train.ground.digest import hashlib\n",
    "kiln_train/model/__init__.py": "",
    "kiln_train/model/net.py": "import torch\n",
    "kiln_train/model/config.py": "from ..ground import digest\n",
    "kiln/__init__.py": "",
    "kiln/store.py": "from kiln_train.errors import KilnError\n",
    "api/__init__.py": "",
    "api/app.py": (
        "from kiln import store\nfrom kiln_train.model import config\n\n\n"
        "def train():\n    from kiln_train.model import net\n"
    ),
    "worker/__init__.py": "",
    "worker/task.py": "from kiln_train.model.net import torch\n",
    "kiln_cli/__init__.py": "",
    "kiln_cli/main.py": "import api.app\nimport worker.task\n",
}


def test_the_repository_has_no_circle_no_folder_cycle_and_no_arrow_back_up():
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.strip().endswith("; 0 problems"), proc.stderr


def test_a_clean_house_has_no_problem(tmp_path):
    plant(tmp_path, CLEAN_HOUSE)
    problems, graph = load_checker().check(tmp_path)
    assert problems == []
    # Relative imports resolve, and `from package import module` points at the module.
    assert graph.arrows["kiln_train.model.config"] == {"kiln_train.ground.digest"}
    assert graph.arrows["api.app"] == {"kiln.store", "kiln_train.model.config", "kiln_train.model.net"}
    assert graph.runtime["api.app"] == {"kiln.store", "kiln_train.model.config"}


def test_a_planted_module_circle_is_reported_even_through_a_function_level_import(tmp_path):
    plant(
        tmp_path,
        {
            **CLEAN_HOUSE,
            "worker/runtime.py": "from worker.records import Recording\n",
            "worker/records.py": "def current():\n    from worker import runtime\n",
        },
    )
    problems, _ = load_checker().check(tmp_path)
    assert problems == ["module circle: worker.records <-> worker.runtime"]


def test_a_planted_folder_cycle_in_kiln_train_is_reported(tmp_path):
    plant(tmp_path, {**CLEAN_HOUSE, "kiln_train/data/labels.py": "from kiln_train.model.config import X\n"})
    problems, _ = load_checker().check(tmp_path)
    # data stands below model: data -> model runs back up, and with model -> ... -> data it
    # would close a cycle; here model does not import data, so only the floor is broken.
    assert problems == [
        "kiln_train/data imports kiln_train/model on its floor or above: "
        "kiln_train.data.labels -> kiln_train.model.config"
    ]
    plant(tmp_path, {"kiln_train/model/config.py": "from kiln_train.data import rows\n"})
    problems, _ = load_checker().check(tmp_path)
    assert "kiln_train folder cycle: data <-> model" in problems


def test_a_new_kiln_train_folder_must_be_given_a_floor(tmp_path):
    plant(tmp_path, {**CLEAN_HOUSE, "kiln_train/extras/__init__.py": "from kiln_train.data import rows\n"})
    problems, _ = load_checker().check(tmp_path)
    assert problems == ["kiln_train/extras has no floor in KILN_TRAIN_FLOORS"]


def test_the_ground_importing_the_service_or_the_cli_is_an_arrow_back_up(tmp_path):
    plant(tmp_path, {**CLEAN_HOUSE, "kiln/broker.py": "def start():\n    import worker.task\n"})
    problems, _ = load_checker().check(tmp_path)
    assert problems == ["kiln imports worker, which stands above it: kiln.broker -> worker.task"]
    plant(tmp_path, {"kiln/broker.py": "from kiln_cli import main\n"})
    problems, _ = load_checker().check(tmp_path)
    assert problems == ["kiln imports kiln_cli, which stands above it: kiln.broker -> kiln_cli.main"]


def test_the_api_importing_the_worker_is_refused(tmp_path):
    plant(tmp_path, {**CLEAN_HOUSE, "api/jobs.py": "def run():\n    from worker import task\n"})
    problems, _ = load_checker().check(tmp_path)
    assert problems == ["api imports worker, which stands above it: api.jobs -> worker.task"]


def test_a_torch_import_the_api_would_load_is_reported_with_its_chain(tmp_path):
    plant(tmp_path, {**CLEAN_HOUSE, "kiln_train/model/config.py": "from kiln_train.model import net\n"})
    problems, _ = load_checker().check(tmp_path)
    assert problems == [
        "api.app loads torch when imported: kiln_train.model.net <- kiln_train.model.config <- api.app"
    ]


def test_the_script_exits_1_and_prints_one_line_per_problem(tmp_path):
    plant(tmp_path, {**CLEAN_HOUSE, "kiln/store.py": "import api.app\n"})
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1
    lines = proc.stdout.strip().splitlines()
    assert any(line.startswith("module circle: api.app <-> kiln.store") for line in lines), lines
    assert "kiln imports api, which stands above it: kiln.store -> api.app" in lines
    assert proc.stderr.strip().endswith(f"; {len(lines)} problems"), proc.stderr
