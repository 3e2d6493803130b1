"""Test setup: Triton runs under its CPU interpreter where there is no GPU; a bounded hypothesis profile for CI; the
fixtures several test files share (plain helpers are in helpers.py)."""

import os
import pathlib

# Must be set before triton.jit decorates lorakit's kernels (torch imports triton lazily).
if not pathlib.Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci", max_examples=25, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev", max_examples=60, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(  # scripts/gpu-check: each property test under a minute on the H200
    "gpu", max_examples=40, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_configure(config):
    config.addinivalue_line("markers", "world(**options): options of the module's `world` fixture (tests/conftest.py)")


@pytest.fixture(scope="module")
def world(request, tmp_path_factory):
    """The served tiny world of a test module, built once per module: (base model, tokenizer, adapter root,
    {name: adapter folder}) for adapters sql, chat and v2 (``_serve_helpers.build_world``).

    A module asks for a variant with ``pytestmark = pytest.mark.world(...)``, build_world's options: ``chat_template``
    (the tokenizer's, replaced), ``max_position_embeddings`` (the base config's, raised) and ``save_model`` (the model
    and tokenizer saved beside the adapter root, at ``world[2].parent / "model"``, for a server process)."""
    from _serve_helpers import build_world

    marker = request.node.get_closest_marker("world")
    options = marker.kwargs if marker is not None else {}
    return build_world(tmp_path_factory.mktemp(request.module.__name__.removeprefix("test_")), **options)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("LORAKIT_GPU_PART"):  # scripts/gpu-check --part K/N: this part's share of the tests
        keep_part(config, items, os.environ["LORAKIT_GPU_PART"])
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def keep_part(config, items, part: str) -> None:
    """Deselect the tests other parts of the GPU check run (tests/_gpu_plan.py deals them out)."""
    from _gpu_plan import DURATIONS, load_durations, parse_part, tests_of_part

    table = load_durations(pathlib.Path(os.environ.get("LORAKIT_GPU_DURATIONS", DURATIONS)))
    mine = tests_of_part(items, parse_part(part), table)
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in mine])
    items[:] = [item for item in items if item.nodeid in mine]


def pytest_runtest_logreport(report):
    """With LORAKIT_TEST_LOG=FILE, one JSON line per test phase as it ends (nodeid, phase, outcome, seconds), written
    at once: scripts/gpu-check reads test durations from it, also from a run cut off before pytest's own reports."""
    path = os.environ.get("LORAKIT_TEST_LOG")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):  # under xdist the controller writes every worker's reports
        return
    import json

    line = dict(nodeid=report.nodeid, when=report.when, outcome=report.outcome, seconds=round(report.duration, 3))
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
