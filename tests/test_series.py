"""scripts/series.sh's maintenance verbs on a throw-away clone (make series-check covers `check`):
export + git apply, a baseline fix through edit 0 / refresh 0, a stage fix through edit 1 /
refresh 1, a fix that conflicts with the next patch, regen, and the refusal when HEAD and the
series disagree.  Git operations only (no
builds): a few seconds.
"""
import os
import shutil
import subprocess

import pytest

from conftest import OUT, REPO

SERIES = os.path.join("scripts", "series.sh")


def sh(args, cwd, check=True, env=None):
    r = subprocess.run(args, cwd=cwd, capture_output=True, text=True, env=env)
    if check:
        assert r.returncode == 0, f"{args} failed ({r.returncode}):\n{r.stdout}{r.stderr}"
    return r


def git(cwd, *args):
    return sh(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd)


@pytest.fixture()
def clone():
    if not os.path.isdir(os.path.join(REPO, ".git")):
        pytest.skip("skipped: not a git checkout")
    top = os.path.join(OUT, "series-test")
    shutil.rmtree(top, ignore_errors=True)
    os.makedirs(top)
    d = os.path.join(top, "repo")
    sh(["git", "clone", "-q", REPO, d], top)       # the committed series (HEAD)
    return top, d


def series(d, *args, check=True):
    return sh(["bash", SERIES, *args], d, check=check)


def patch_files(d):
    names = [l.strip() for l in open(os.path.join(d, "patches", "series")) if l.strip()]
    assert names, "empty series"
    return names


def test_export_then_apply(clone):
    top, d = clone
    series(d, "export", os.path.join(top, "exp"))
    base = os.path.join(top, "exp", "base")
    assert not os.path.exists(os.path.join(base, "patches"))
    same = subprocess.run(["diff", "-rq", "-x", "patches", "-x", ".git", base, d], capture_output=True)
    assert same.returncode == 1, "the exported baseline equals HEAD: nothing was reverse-applied"
    # the reviewer's git apply, as a plain patch tool (OUT may sit inside a checkout)
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=os.path.dirname(os.path.realpath(base)))
    for p in patch_files(d):
        sh(["git", "apply", os.path.join(top, "exp", "patches", p)], base, env=env)
    # the baseline + every patch is HEAD's tree outside patches/
    r = subprocess.run(["diff", "-r", "-x", "patches", "-x", ".git", base, d], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[:2000]


def test_baseline_fix_through_refresh(clone):
    top, d = clone
    e = os.path.join(top, "e0")
    series(d, "edit", "0", e)
    target = os.path.join(e, "ds4_quant.c")
    with open(target, "a") as f:
        f.write("/* a baseline fix */\n")
    series(d, "refresh", "0", e)
    assert open(os.path.join(d, "ds4_quant.c")).read().endswith("/* a baseline fix */\n")
    git(d, "commit", "-qam", "baseline fix")
    b = os.path.join(top, "b")
    series(d, "base", b)
    assert open(os.path.join(b, "ds4_quant.c")).read().endswith("/* a baseline fix */\n")


def test_stage_fix_through_refresh(clone):
    top, d = clone
    n = len(patch_files(d))
    last = patch_files(d)[-1]
    e = os.path.join(top, "e1")
    series(d, "edit", str(n), e)
    added = os.path.join(e, "series-test-added.txt")
    with open(added, "w") as f:
        f.write("added by the newest stage\n")
    series(d, "refresh", str(n), e)
    assert os.path.exists(os.path.join(d, "series-test-added.txt"))
    text = open(os.path.join(d, "patches", last)).read()
    assert "series-test-added.txt" in text
    assert text.startswith("From ")                        # the header survived
    git(d, "add", "-A")
    git(d, "commit", "-qm", "stage fix")
    b = os.path.join(top, "b")
    series(d, "base", b)
    assert not os.path.exists(os.path.join(b, "series-test-added.txt"))
    # a commit that changes a patched file without refreshing: HEAD != baseline + series,
    # and the series says so instead of producing a wrong baseline
    with open(os.path.join(d, "series-test-added.txt"), "a") as f:
        f.write("and one more line\n")
    git(d, "commit", "-qam", "more stage work, no refresh")
    r = series(d, "base", os.path.join(top, "b2"), check=False)
    assert r.returncode == 2 and "does not reverse-apply" in r.stderr, r.stderr


def test_regen_after_more_work(clone):
    """More commits of the newest stage, folded in by regen; also right after a baseline fix."""
    top, d = clone
    names = patch_files(d)
    # a baseline fix first (edit 0 / refresh 0, committed: the series is consistent again)
    e = os.path.join(top, "e0")
    series(d, "edit", "0", e)
    with open(os.path.join(e, "ds4_quant.c"), "a") as f:
        f.write("/* a baseline fix */\n")
    series(d, "refresh", "0", e)
    git(d, "commit", "-qam", "baseline fix")
    # then more work on the newest stage, and regen against the commit before it
    with open(os.path.join(d, "series-test-regen.txt"), "w") as f:
        f.write("more work on the newest stage\n")
    git(d, "add", "-A")
    git(d, "commit", "-qm", "more work")
    series(d, "regen", "HEAD~1")
    text = open(os.path.join(d, "patches", names[-1])).read()
    assert "series-test-regen.txt" in text and text.startswith("From ")
    files = [l.split()[2] for l in text.split("\n") if l.startswith("diff --git ")]
    assert "series-test-regen.txt" in " ".join(files) and "a/ds4_quant.c" not in files   # the fix stays in the baseline
    git(d, "commit", "-qam", "regen")
    b = os.path.join(top, "b")
    series(d, "base", b)
    assert not os.path.exists(os.path.join(b, "series-test-regen.txt"))
    assert open(os.path.join(b, "ds4_quant.c")).read().endswith("/* a baseline fix */\n")


def first_changed_line(patch_text):
    """(path, old line number, old text) of the first line a patch removes from a text file."""
    path, old_no = None, 0
    for l in patch_text.split("\n"):
        if l.startswith("diff --git "):
            path = None
        elif l.startswith("--- a/"):
            path = l[6:]
        elif l.startswith("@@ ") and path:
            old_no = int(l.split()[1].split(",")[0][1:])
        elif path and old_no and l.startswith("-") and not l.startswith("---"):
            return path, old_no, l[1:]
        elif path and old_no and (l.startswith(" ") or l == ""):
            old_no += 1
    raise AssertionError("the newest patch removes no line")


def test_conflict_then_refresh_next(clone):
    """A fix to stage N-1 that conflicts with patch N stops refresh N-1 with a message; resolved
    in the edit worktree, refresh N finishes the job and the series is consistent again."""
    top, d = clone
    names = patch_files(d)
    n = len(names)
    path, line_no, text = first_changed_line(open(os.path.join(d, "patches", names[-1])).read())
    e = os.path.join(top, "ec")
    series(d, "edit", str(n - 1), e)
    f = os.path.join(e, path)
    lines = open(f).read().split("\n")
    assert lines[line_no - 1] == text
    lines[line_no - 1] = "series-conflict-test"
    open(f, "w").write("\n".join(lines))
    r = series(d, "refresh", str(n - 1), e, check=False)
    assert r.returncode == 2 and f"then refresh {n} " in r.stderr, r.stderr
    sh(["git", "checkout", "--theirs", "--", path], e)          # keep the newest stage's line
    git(e, "add", "-A")
    git(e, "commit", "-qm", "resolved")
    series(d, "refresh", str(n), e)
    assert "series-conflict-test" in open(os.path.join(d, "patches", names[-2])).read()
    assert "series-conflict-test" not in open(os.path.join(d, path)).read()
    git(d, "add", "-A")
    git(d, "commit", "-qm", "stage fix through a conflict")
    t = os.path.join(top, "t")
    series(d, "tree", str(n - 1), t)
    assert "series-conflict-test" in open(os.path.join(t, path)).read()
    series(d, "base", os.path.join(top, "b"))                  # baseline + series == HEAD


def test_bad_usage(clone):
    top, d = clone
    assert series(d, "edit", "99", os.path.join(top, "x"), check=False).returncode == 2
    assert series(d, "add", "Bad_Name", "HEAD", check=False).returncode == 2
    assert series(d, "frobnicate", check=False).returncode == 2


def test_patches_readme_lists_every_patch():
    """patches/README.md's table names every patch of the series, in order, with its size as
    `git apply --numstat` counts it (a regenerated patch whose size moved must be restated)."""
    names = patch_files(REPO)
    rows = [l for l in open(os.path.join(REPO, "patches", "README.md")) if l.startswith("| `0")]
    assert [r.split("`")[1] for r in rows] == names
    for name, row in zip(names, rows):
        out = sh(["git", "apply", "--numstat", os.path.join("patches", name)], REPO).stdout
        add = dele = 0
        for line in out.splitlines():
            a, d, _ = line.split("\t", 2)
            add += int(a) if a != "-" else 0
            dele += int(d) if d != "-" else 0
        size = f"+{add:,}/\u2212{dele:,}, {len(out.splitlines())} files"
        assert f"| {size} |" in row, f"{name}: patches/README.md says {row.split('|')[3].strip()}, the patch is {size}"
