"""Test-session setup shared by `tests/` and the doctests in `tunelib/`.

Runs before anything imports JAX or tunelib: simulates 8 CPU devices, turns on runtime shape
and dtype checking of every annotated tunelib function (jaxtyping + beartype), and registers
the hypothesis profiles. It also makes one JAX compilation cache for the session, which the
test processes and the recipe runs they start as subprocesses share
(`tests._helpers.user_env`).

The suite compiles thousands of small programs and runs each a few times, so compiling is
most of its time. Four settings make it cheaper without changing what is computed: XLA's
backend skips its most expensive LLVM passes (`JAX_DISABLE_MOST_OPTIMIZATIONS`; the HLO
optimisations, fusion included, still run, so results differ from a fully optimised build at
most in the order of a reduction); the CPU backend emits fused kernels with its older
elemental emitter, which compiles small programs two to three times faster than the MLIR
fusion emitters (`--xla_cpu_use_fusion_emitters=false`); it generates each program's machine
code as one LLVM module instead of splitting it for parallel codegen threads, which the
xdist workers (one more than the cores) cannot use (`--xla_cpu_parallel_codegen_split_count=1`:
17 % off `tests/losses` and `tests/models`); and programs that took long to compile are shared
through the session's compilation cache between the xdist workers and the recipe runs.

Tracing and lowering those programs allocate many short-lived Python objects, and at Python's
default thresholds the garbage collector ran thousands of times over a heap that the imports
and the collected tests make large. With a young generation of 50,000 objects and the heap
as collected frozen (`gc.freeze`: never scanned again), `tests/models` and `tests/losses`
took 10 to 13 % less CPU time (297 -> 257-262 s). The recipes do the like
(`kit.cli.GC_THRESHOLDS`).

The accelerator tier (tests marked `accelerator`, docs/tpu.md) runs where `JAX_PLATFORMS`
names a GPU or a TPU: then none of the CPU settings above applies (they change what an
accelerator computes, or are flags of XLA's CPU backend alone), and the host's CPU backend is
added beside the accelerator, where the tier computes its references. Elsewhere its tests
skip, saying which backend JAX has, unless `TUNELIB_ACCELERATOR_TESTS_ON_CPU=1` asks for them
on the CPU (the Pallas kernels in the interpreter), to check the tests themselves.
"""

import gc
import os
import shutil
import tempfile

ACCELERATOR_PLATFORMS = ("tpu", "gpu", "cuda", "rocm")
ON_CPU_VARIABLE = "TUNELIB_ACCELERATOR_TESTS_ON_CPU"
_PLATFORMS = [p.strip() for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
ON_ACCELERATOR = any(p in ACCELERATOR_PLATFORMS for p in _PLATFORMS)

if ON_ACCELERATOR:
    if "cpu" not in _PLATFORMS:  # the host, for the references (JAX starts only those named)
        os.environ["JAX_PLATFORMS"] = ",".join([*_PLATFORMS, "cpu"])
else:
    _FLAGS = (
        "--xla_force_host_platform_device_count=8",
        "--xla_cpu_use_fusion_emitters=false",
        "--xla_cpu_parallel_codegen_split_count=1",
    )
    for _flag in _FLAGS:
        if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from jaxtyping import install_import_hook  # noqa: E402

install_import_hook("tunelib", "beartype.beartype")

# The suite's profile: the same 8 examples of every property on every run (hypothesis draws
# its simplest, boundary cases first); `HYPOTHESIS_PROFILE=dev` draws 200 at random.
settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile("dev", max_examples=200, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# The session's compilation cache: most recipe runs in the tests compile the same train and
# evaluation steps, and compiling is most of a short run's time. Made by the main process
# (pytest-xdist's workers inherit the variable) and removed at the end of the session.
_CACHE_VARIABLE = "TUNELIB_TEST_COMPILATION_CACHE"


def pytest_configure(config):
    gc.set_threshold(50_000, 20, 100)
    if not hasattr(config, "workerinput") and _CACHE_VARIABLE not in os.environ:
        os.environ[_CACHE_VARIABLE] = tempfile.mkdtemp(prefix="tunelib-test-jax-cache-")
        config._tunelib_cache = os.environ[_CACHE_VARIABLE]
    if _CACHE_VARIABLE in os.environ:  # every test process: share what is costly to compile
        import jax

        jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_VARIABLE])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent without it (`-p no:xdist`)
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (the suite's setting): one worker more than the cores this process may use.
    Part of the suite waits instead of computing (on the recipe and benchmark processes it
    starts, on the supervisor tests' sleeps): from clean clones on 2 cores, 2 workers kept
    1.87 cores busy on average (CPU time over wall time) and 3 workers 1.96."""
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    return (len(cores) if cores else os.cpu_count() or 1) + 1


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    folder = getattr(config, "_tunelib_cache", None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
        del os.environ[_CACHE_VARIABLE]


# docs/own_loop.md runs on the GGUF file named `model_path`: in the suite's doctests a tiny
# file of SmolLM2's layout (Q8_0 blocks, byte-level BPE, ChatML), written once per process.
OWN_LOOP_PAGE = "own_loop.md"
OWN_LOOP_MESSAGES = (
    "What is the capital of France?",
    "Paris is the capital of France.",
    "Write a haiku about rain. Soft rain on the roof. I cannot do that. London.",
)


@pytest.fixture(scope="session")
def tiny_gguf_file(tmp_path_factory):
    from tests._gguf import write_tiny_gguf

    folder = tmp_path_factory.mktemp("tiny-gguf")
    return write_tiny_gguf(folder / "tiny.gguf", OWN_LOOP_MESSAGES, dtype="Q8_0")


@pytest.fixture(autouse=True)
def _own_loop_model(request, doctest_namespace):
    if request.node.path.name == OWN_LOOP_PAGE:
        doctest_namespace["model_path"] = request.getfixturevalue("tiny_gguf_file")


def pytest_collection_modifyitems(items):
    """The modules with long end-to-end runs (marked `slow`) first, each kept whole (its
    module-scoped fixtures made once), the rest in their usual order; the tests marked
    `accelerator` skipped, with the reason, where JAX has no GPU or TPU.

    pytest-xdist's workers then start on the runs of a minute or more and fill in with
    the short tests, instead of one worker finishing a recipe run alone at the end while the
    others wait. The order changes when a test runs, never what it checks."""

    def module(item):
        return item.nodeid.split("::")[0]

    slow = {module(item) for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: module(item) not in slow)
    tier = [item for item in items if item.get_closest_marker("accelerator")]
    if tier and (skip := _accelerator_skip()) is not None:
        for item in tier:
            item.add_marker(skip)


def _accelerator_skip():
    """The skip of the accelerator tier on this backend, or None where it runs."""
    import jax

    backend = jax.default_backend()
    if backend in ACCELERATOR_PLATFORMS or os.environ.get(ON_CPU_VARIABLE) == "1":
        return None
    return pytest.mark.skip(
        reason=f"needs a GPU or TPU; JAX's backend is {backend} "
        f"(JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '')}): run the tier with "
        f"JAX_PLATFORMS=tpu (docs/tpu.md), or on this CPU with {ON_CPU_VARIABLE}=1"
    )
