"""Several Ray nodes (real raylets on this machine): the cases of tests/multinode_cases.py, run in a child pytest.

Why a child process: this session's Ray (tests/conftest.py ``ray_session``) is one node started once and shared by
every Ray test; a driver joins one cluster per process, and these cases need a cluster of their own — a head and
worker nodes with their own CPUs, one of which they kill. Making the session's Ray a multi-node ``Cluster`` for
everyone instead would put every other test's replicas on nodes it did not choose, keep two extra raylets up for the
whole session, and let a node removal break the apps of later tests. The child starts its cluster once for all
cases (the cost of this file), in its own RAY_TMPDIR, and is gone, Ray and all, when its cases end.

Each case below is one case of the child run (its outcome read from the child's JUnit XML): passed, failed (with the
child's message and output), skipped, or xfailed with the child's reason.
"""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

CASES = Path(__file__).with_name("multinode_cases.py")
CHILD_TIMEOUT_S = 600
OUTPUT_TAIL_CHARS = 6000


def case_names() -> list[str]:
    tree = ast.parse(CASES.read_text())
    return [node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]


@pytest.fixture(scope="module")
def child_run(tmp_path_factory, tiny_llama_dir) -> tuple[dict[str, tuple[str, str]], str]:
    """Run every case once in a child pytest; returns ({case: (outcome, message)}, the child's output)."""
    report = tmp_path_factory.mktemp("multinode") / "junit.xml"
    env = {**os.environ, "PREFIXSERVE_TINY_LLAMA_DIR": tiny_llama_dir}
    env.pop("RAY_ADDRESS", None)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=-ra",
               f"--junitxml={report}", str(CASES)]
    process = subprocess.Popen(command, cwd=CASES.parent.parent, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the child's Ray processes share its process group
        output, _ = process.communicate()
        output += f"\n[killed after {CHILD_TIMEOUT_S} s]"
    outcomes: dict[str, tuple[str, str]] = {}
    if report.exists():
        for case in ET.parse(report).getroot().iter("testcase"):
            outcome, message = "passed", ""
            for child in case:
                if child.tag in ("failure", "error"):
                    outcome, message = "failed", f"{child.get('message', '')}\n{child.text or ''}"
                elif child.tag == "skipped":
                    outcome = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
                    message = child.get("message", "")
            if outcomes.get(case.get("name"), ("passed",))[0] == "passed":  # a teardown error overrides a pass
                outcomes[case.get("name")] = (outcome, message)
    return outcomes, output


@pytest.mark.parametrize("case", case_names())
def test_multinode(child_run, case):
    outcomes, output = child_run
    if case not in outcomes:
        pytest.fail(f"{case} did not run in the child pytest; its output:\n{output[-OUTPUT_TAIL_CHARS:]}")
    outcome, message = outcomes[case]
    if outcome == "xfailed":
        pytest.xfail(message)
    if outcome == "skipped":
        pytest.skip(message)
    if outcome == "failed":
        pytest.fail(f"{message}\n--- child output (tail) ---\n{output[-OUTPUT_TAIL_CHARS:]}", pytrace=False)
