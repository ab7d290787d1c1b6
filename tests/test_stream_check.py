"""scripts/check_streams.py: the stage-0 and stage-1 invariants (every GPU operation on ds4_current_stream(),
every wait marked, every allocation and wait counted) and stage 2's (every kernel starts with its
programmatic-dependent-launch wait).

The repository passes; each rule fails on a planted violation, both in a small file and inside a
copy of the real ds4_cuda.cu; comments and strings do not count.
"""
import os
import subprocess
import sys

import pytest

from conftest import OUT, REPO

CHECK = os.path.join(REPO, "scripts", "check_streams.py")


def check(*args):
    return subprocess.run([sys.executable, CHECK, *args], capture_output=True, text=True)


def test_repository_is_clean():
    r = check()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 violations" in r.stdout


GOOD = """\
#define DS4_CUBLAS(...) do { cublasSetStream(g.blas, ds4_current_stream()); (__VA_ARGS__); } while (0)
static void f(void) {
    k<<<g, b, 0, ds4_current_stream()>>>(x);
    cudaMemsetAsync(p, 0, n, ds4_current_stream());
    cudaEventRecord(ev, ds4_current_stream());
    DS4_CUBLAS(cublasSgemm(h, a, b));
    /* NOTE(step result): the logits */
    cudaMemcpy(d, s, n, cudaMemcpyDeviceToHost);
    g_n_stream_sync++;
    cudaStreamSynchronize(ds4_current_stream());   /* NOTE(step result) */
    while (cudaStreamQuery(ds4_current_stream()) != cudaSuccess) {}   /* NOTE(hook room) */
    // a comment: k<<<1, 1>>>(); cudaMemset(p, 0, n); cublasSgemm(h);
    puts("cudaMemset(p, 0, n) <<<1, 1>>> cudaDeviceSynchronize()");
}
"""

PLANTED = {
    "launch-no-stream": ("k<<<g, b>>>(x);", "launch"),
    "launch-stream-0": ("k<<<g, b, 0, 0>>>(x);", "launch"),
    "memset": ("cudaMemset(p, 0, n);", "memset"),
    "memcpy-async": ("cudaMemcpyAsync(d, s, n, cudaMemcpyDeviceToDevice, 0);", "stream"),
    "event": ("cudaEventRecord(ev, 0);", "stream"),
    "host-func": ("cudaLaunchHostFunc(0, fn, NULL);", "stream"),
    "cublas-bare": ("cublasSgemm(h, a, b);", "cublas"),
    "sync-unmarked": ("cudaDeviceSynchronize();", "sync"),
    "memcpy-unmarked": ("cudaMemcpy(d, s, n, cudaMemcpyHostToDevice);", "sync"),
    "stage0-marker": ("cudaStreamSynchronize(s); /* NOTE(stage 1) */", "sync"),
    # the hook drain's exemption needs both its stream and its marker
    "drain-unmarked": ("cudaMemcpyAsync(d, s, n, cudaMemcpyDeviceToHost, E->drain);", "stream"),
    "drain-other-stream": ("cudaMemcpyAsync(d, s, n, cudaMemcpyDeviceToHost, 0); /* NOTE(hook drain) */", "stream"),
    "drain-sync-other": ("cudaStreamSynchronize(s); /* NOTE(hook drain) */", "sync"),
    "poll-unmarked": ("while (cudaStreamQuery(ds4_current_stream()) != cudaSuccess) {}", "sync"),
}


def test_hook_drain_exemption_passes():
    """ds4_hooks.cu's drain thread copies and waits on its own stream, marked."""
    text = GOOD.replace("static void f(void) {\n", "static void f(void) {\n"
                        "    /* NOTE(hook drain) */\n    cudaMemcpyAsync(d, s, n, cudaMemcpyDeviceToHost, E->drain);\n"
                        "    cudaStreamSynchronize(E->drain);   /* NOTE(hook drain) */\n", 1)
    r = check("--engine", write("drain-ok", text))
    assert r.returncode == 0, r.stdout


def test_uncounted_allocation_fails():
    """A cudaMalloc or a wait in a function that bumps no g_n_ counter is a count violation."""
    text = GOOD + "static void g(void) {\n    cudaMalloc(&p, 16);\n    cudaFree(p);\n}\n"
    r = check("--engine", write("count", text))
    assert r.returncode == 1, r.stdout
    assert r.stdout.count("count:") == 2, r.stdout


def write(name, text):
    p = os.path.join(OUT, f"streamcheck-{name}.cu")
    with open(p, "w") as f:
        f.write(text)
    return p


def test_good_snippet_passes():
    r = check("--engine", write("good", GOOD))
    assert r.returncode == 0, r.stdout


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_planted_violation_fails(name):
    stmt, rule = PLANTED[name]
    text = GOOD.replace("static void f(void) {\n", "static void f(void) {\n\n\n\n    " + stmt + "\n", 1)
    r = check("--engine", write(name, text))
    assert r.returncode == 1, r.stdout
    assert f":6: {rule}:" in r.stdout, r.stdout          # the planted line, named
    assert "1 violation" in r.stdout


KERNELS = """\
__device__ __forceinline__ void ds4_grid_dep(void) {}
template <int N>
__global__ void __launch_bounds__(N) k_good(const float *x, float *y, int n) {
    ds4_grid_dep();
    y[0] = x[0];
}
__global__ void k_small(void) { ds4_grid_dep(); }
__global__ void k_declared(float *y);
"""


def test_kernels_start_with_grid_dep():
    """pdl: every kernel's first statement is ds4_grid_dep(); a declaration is not a kernel body."""
    assert check("--engine", write("pdl-good", KERNELS)).returncode == 0
    late = KERNELS.replace("    ds4_grid_dep();\n    y[0] = x[0];\n", "    y[0] = x[0];\n    ds4_grid_dep();\n", 1)
    r = check("--engine", write("pdl-late", late))
    assert r.returncode == 1 and ":3: pdl:" in r.stdout and "1 violation" in r.stdout, r.stdout
    none = KERNELS.replace("{ ds4_grid_dep(); }", "{ }", 1)
    r = check("--engine", write("pdl-none", none))
    assert r.returncode == 1 and ":7: pdl:" in r.stdout, r.stdout
    assert check("--other", write("pdl-other", none)).returncode == 0


PROLOGUE = """\
__device__ __forceinline__ void ds4_grid_dep(void) {}
__global__ void k_pro(const float *w, const float *x, float *y) {
    /* NOTE(pdl prologue): w is a weight */
    const float a = w[0];
    const float b = w[1];
    const float c = w[2];
    const float d = w[3];
    ds4_grid_dep();   /* NOTE(pdl prologue): x is the kernel before's */
    y[0] = a * b * c * d * x[0];
}
"""


def test_kernel_prologue_marked():
    """pdl: a reviewed prologue before the wait passes only with the marker at the top and at
    every wait of the body."""
    r = check("--engine", write("pro-good", PROLOGUE))
    assert r.returncode == 0, r.stdout
    for name, text in [
        ("pro-no-top", PROLOGUE.replace("/* NOTE(pdl prologue): w is a weight */", "/* w is a weight */")),
        ("pro-no-wait-mark", PROLOGUE.replace("   /* NOTE(pdl prologue): x is the kernel before's */", "")),
        ("pro-no-wait", PROLOGUE.replace("    ds4_grid_dep();   /* NOTE(pdl prologue): x is the kernel before's */\n", "")),
    ]:
        r = check("--engine", write(name, text))
        assert r.returncode == 1 and ":2: pdl:" in r.stdout, (name, r.stdout)


def test_define_without_set_stream_fails():
    text = GOOD.replace("cublasSetStream(g.blas, ds4_current_stream()); ", "", 1)
    r = check("--engine", write("define", text))
    assert r.returncode == 1 and "cublas: DS4_CUBLAS does not call cublasSetStream" in r.stdout, r.stdout


def test_sync_rule_only_for_engine_files():
    text = GOOD.replace("    /* NOTE(step result): the logits */\n", "", 1)
    assert check("--engine", write("sync-engine", text)).returncode == 1
    assert check("--other", write("sync-other", text)).returncode == 0


def test_planted_in_the_real_backend():
    """A raw launch and a synchronous memset put into a copy of ds4_cuda.cu are both found."""
    src = open(os.path.join(REPO, "ds4_cuda.cu")).read()
    anchor = "static void cuda_free(void *p) {\n"
    assert anchor in src
    src = src.replace(anchor, anchor + "    k_scale<<<1, 32>>>((float *)p, 1.0f, 1);\n    cudaMemset(p, 0, 4);\n", 1)
    r = check("--engine", write("real", src))
    assert r.returncode == 1
    assert "launch:" in r.stdout and "memset:" in r.stdout and "2 violations" in r.stdout, r.stdout
