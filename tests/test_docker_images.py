"""What the container images need at run time, read from their Dockerfiles (Docker cannot
run here, so the files are parsed: stages, RUN's apt-get installs, ENV, VOLUME, WORKDIR).

CUDA image: Triton builds a C launcher for each kernel signature at its first launch, with
the C compiler on PATH against the interpreter's ``Python.h``, and caches it (and every
compiled kernel) in ``TRITON_CACHE_DIR``.  So the runtime stage must install a C compiler,
the libc headers and the ``python3.X-dev`` of the interpreter the venv links, and set
``TRITON_CACHE_DIR`` to a directory that stays writable under a read-only root.

CPU image: the fused CPU decoder is compiled in the build stage into the installed package
(``load_library`` looks next to its source first); the runtime stage has no compiler, so the
libraries must land in the venv that stage copies, not in a source tree beside it.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

DOCKER = Path(__file__).resolve().parents[1] / "docker"

# The python3 package of each Ubuntu release the CUDA base images come in.
UBUNTU_PYTHON = {"20.04": "3.8", "22.04": "3.10", "24.04": "3.12"}
COMPILERS = re.compile(r"^(gcc|clang|build-essential)(-\d+)?$")
LIBC_HEADERS = {"libc6-dev", "libc-dev", "build-essential"}
# Parts of a read-only root that are no cache: the image's own files.
NOT_CACHES = ("/opt", "/usr", "/etc", "/bin", "/sbin", "/lib", "/lib64", "/home", "/root", "/src")


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (KEYWORD, arguments)

    def args(self, keyword: str) -> list[str]:
        return [a for k, a in self.instructions if k == keyword]


def parse_dockerfile(text: str) -> list[Stage]:
    """Stages in order; continuation lines joined, comments and blank lines dropped."""
    lines, buf = [], ""
    for raw in text.splitlines():
        s = raw.strip()
        if not buf and (not s or s.startswith("#")):
            continue
        if buf and s.startswith("#"):  # a comment inside a continued instruction
            continue
        if s.endswith("\\"):
            buf += s[:-1] + " "
            continue
        lines.append(buf + s)
        buf = ""
    stages: list[Stage] = []
    for line in lines:
        keyword, _, rest = line.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "FROM":
            words = rest.split()
            words = [w for w in words if not w.startswith("--")]  # --platform=...
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name))
        elif keyword != "ARG" or stages:  # ARGs before the first FROM belong to no stage
            stages[-1].instructions.append((keyword, rest))
    return stages


def runtime_stage(stages: list[Stage]) -> Stage:
    """The last stage named ``runtime``, else the final stage (what ``docker build`` ships)."""
    named = [s for s in stages if s.name == "runtime"]
    return named[-1] if named else stages[-1]


def shell_commands(stage: Stage) -> list[list[str]]:
    """Each RUN split into simple commands (at &&, ||, ;, | and &), as word lists."""
    out: list[list[str]] = []
    for run in stage.args("RUN"):
        lex = shlex.shlex(run, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        words: list[str] = []
        for tok in lex:
            if tok in ("&&", "||", ";", "|", "&"):
                out += [words] if words else []
                words = []
            else:
                words.append(tok)
        out += [words] if words else []
    return out


def apt_packages(stage: Stage) -> set[str]:
    pkgs: set[str] = set()
    for words in shell_commands(stage):
        if words[0] in ("apt-get", "apt") and "install" in words:
            for w in words[words.index("install") + 1 :]:
                if not w.startswith("-"):
                    pkgs.add(w.split("=", 1)[0])  # pkg=version
    return pkgs


def env(stage: Stage) -> dict[str, str]:
    """The stage's ENV (both forms: ``K=V K2=V2`` and the legacy ``K V``)."""
    out: dict[str, str] = {}
    for a in stage.args("ENV"):
        words = shlex.split(a)
        if words and "=" not in words[0]:
            out[words[0]] = " ".join(words[1:])
            continue
        for w in words:
            k, _, v = w.partition("=")
            out[k] = v
    return out


def volumes(stage: Stage) -> list[str]:
    out: list[str] = []
    for a in stage.args("VOLUME"):
        a = a.strip()
        out += [str(v) for v in (json.loads(a) if a.startswith("[") else a.split())]
    return out


def under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def interpreter(stage: Stage) -> str | None:
    """The Python version of the stage: the python3.X that makes its venv, else an
    explicit python3.X package, else the Ubuntu release's python3 (from the base image's tag)."""
    for words in shell_commands(stage):
        if re.fullmatch(r"python3\.\d+", words[0]) and words[1:3] == ["-m", "venv"]:
            return words[0].removeprefix("python")
    pkgs = apt_packages(stage)
    explicit = sorted(p.removeprefix("python") for p in pkgs if re.fullmatch(r"python3\.\d+", p))
    if explicit:
        return explicit[-1]
    if "python3" in pkgs:
        m = re.search(r"ubuntu(\d\d\.\d\d)", stage.base)
        return UBUNTU_PYTHON.get(m.group(1)) if m else None
    m = re.match(r"python:(3\.\d+)", stage.base)  # the official python images
    return m.group(1) if m else None


def source_stage(stages: list[Stage], stage: Stage, path: str) -> Stage | None:
    """The stage that ``COPY --from=<name> <path>`` in ``stage`` copies from."""
    for a in stage.args("COPY"):
        words = a.split()
        src = [w.split("=", 1)[1] for w in words if w.startswith("--from=")]
        if src and path in words:
            return next((s for s in stages if s.name == src[0]), None)
    return None


# ---------------------------------------------------------------- what each image must have
def cuda_problems(text: str) -> list[str]:
    stages = parse_dockerfile(text)
    rt = runtime_stage(stages)
    pkgs = apt_packages(rt)
    problems = []
    if not any(COMPILERS.match(p) for p in pkgs):
        problems.append("runtime stage installs no C compiler (gcc, clang or build-essential)")
    if not pkgs & LIBC_HEADERS:
        problems.append("runtime stage installs no libc headers (libc6-dev)")
    version = interpreter(rt)
    build = source_stage(stages, rt, "/opt/venv")
    if build is not None and interpreter(build) != version:
        problems.append(f"the venv links python {interpreter(build)} but the runtime stage installs {version}")
    dev = {f"python{version}-dev", f"libpython{version}-dev"}
    m = re.search(r"ubuntu(\d\d\.\d\d)", rt.base)
    if m and UBUNTU_PYTHON.get(m.group(1)) == version:
        dev |= {"python3-dev", "libpython3-dev"}
    if version is None or not pkgs & dev:
        problems.append(f"runtime stage installs no Python headers for its python {version} (python{version}-dev)")
    cache = env(rt).get("TRITON_CACHE_DIR")
    if not cache:
        problems.append("runtime stage does not set TRITON_CACHE_DIR")
    else:
        writable = ["/tmp", *volumes(rt)]
        if not cache.startswith("/") or any(under(cache, ro) for ro in NOT_CACHES) or \
                not any(under(cache, w) for w in writable):
            problems.append(f"TRITON_CACHE_DIR={cache} is not writable under a read-only root "
                            f"(writable there: {', '.join(writable)})")
        made = [w for words in shell_commands(rt) if words[:2] == ["mkdir", "-p"] for w in words[2:]]
        owned = [w for words in shell_commands(rt) if words[0] == "chown" for w in words[2:]]
        if not under(cache, "/tmp") and not (any(under(cache, d) for d in made) and
                                            any(under(cache, d) for d in owned)):
            problems.append(f"TRITON_CACHE_DIR={cache} is not created and given to the runtime user")
    return problems


def cpu_problems(text: str) -> list[str]:
    stages = parse_dockerfile(text)
    rt = runtime_stage(stages)
    if {"gcc", "libc6-dev"} <= apt_packages(rt):
        return []  # the decoder can be built at run time (into SPECSERVE_CACHE_DIR/kernels)
    build = source_stage(stages, rt, "/opt/venv")
    if build is None:
        return ["the runtime stage copies no /opt/venv from a build stage"]
    problems = []
    workdir = "/"
    copied: set[str] = set()  # directories of the build stage holding a copy of the package
    built_ok = None
    compiler = False
    for keyword, a in build.instructions:
        if keyword == "WORKDIR":
            workdir = a if a.startswith("/") else f"{workdir.rstrip('/')}/{a}"
        elif keyword == "COPY" and a.split()[-2:-1] and a.split()[-2].rstrip("/") == "specserve":
            copied.add(workdir)
        elif keyword == "RUN":
            for words in shell_commands(Stage(build.base, None, [("RUN", a)])):
                if words[0] in ("apt-get", "apt") and "install" in words:
                    compiler = compiler or ({"gcc", "libc6-dev"} <= set(words))
                if "specserve.kernels.cpu_decoder" not in words:
                    continue
                if not compiler:
                    problems.append("the fused CPU decoder is built before gcc and libc6-dev are installed")
                flags = words[1 : words.index("-m")] if "-m" in words else []
                target = words[words.index("specserve.kernels.cpu_decoder") + 1 :]
                into_venv = (target and under(target[0], "/opt/venv")) or (not target and (
                    "-P" in flags or "-I" in flags or workdir not in copied))
                built_ok = bool(into_venv)
    if built_ok is None:
        problems.append("the build stage does not prebuild the fused CPU decoder "
                        "(python -m specserve.kernels.cpu_decoder)")
    elif not built_ok:
        problems.append("python -m specserve.kernels.cpu_decoder runs in a WORKDIR holding the source: it imports "
                        "that copy and builds the libraries outside the venv (use python -P)")
    return problems


# ---------------------------------------------------------------- the images
def test_cuda_runtime_stage_can_build_triton_launchers():
    assert cuda_problems((DOCKER / "Dockerfile.cuda").read_text()) == []


def test_cpu_image_ships_the_prebuilt_fused_decoder_in_its_venv():
    assert cpu_problems((DOCKER / "Dockerfile.cpu").read_text()) == []


# ---------------------------------------------------------------- the checks themselves
CUDA_RUNTIME_TODAY = """\
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04 AS build
RUN apt-get update \\
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates
RUN python3 -m venv /opt/venv
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG UID=10001
RUN apt-get update \\
 && apt-get install -y --no-install-recommends python3 ca-certificates \\
 && mkdir -p /cache /models \\
 && chown "${UID}:${UID}" /cache /models
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \\
    SPECSERVE_CACHE_DIR=/cache
USER ${UID}:${UID}
"""


def test_the_cuda_check_names_what_a_runtime_stage_lacks():
    assert cuda_problems(CUDA_RUNTIME_TODAY) == [
        "runtime stage installs no C compiler (gcc, clang or build-essential)",
        "runtime stage installs no libc headers (libc6-dev)",
        "runtime stage installs no Python headers for its python 3.12 (python3.12-dev)",
        "runtime stage does not set TRITON_CACHE_DIR",
    ]


@pytest.mark.parametrize("old, new, problem", [
    ("python3.12-dev", "python3.11-dev", "installs no Python headers for its python 3.12"),
    (" gcc ", " ", "installs no C compiler"),
    ("TRITON_CACHE_DIR=/var/cache/specserve/triton", "TRITON_CACHE_DIR=/opt/venv/triton", "is not writable"),
    ('VOLUME ["/var/cache/specserve/triton"]', "", "is not writable under a read-only root"),
    ("/var/cache/specserve/triton \\\n && chown", "\\\n && chown", "is not created and given to the runtime user"),
    ("python3.12 -m venv", "python3.11 -m venv", "the venv links python 3.11"),
    ("python3.12 python3.12-dev gcc", "python3.11 python3.11-dev gcc", "the venv links python 3.12 but the runtime"),
])
def test_the_cuda_check_catches_each_mistake(old, new, problem):
    text = (DOCKER / "Dockerfile.cuda").read_text()
    assert old in text
    found = cuda_problems(text.replace(old, new))
    assert any(problem in p for p in found), found


def test_the_cpu_check_catches_a_decoder_built_into_the_source_tree():
    text = (DOCKER / "Dockerfile.cpu").read_text()
    assert "python -P -m specserve.kernels.cpu_decoder" in text
    shadowed = text.replace("python -P -m specserve.kernels.cpu_decoder", "python -m specserve.kernels.cpu_decoder")
    assert cpu_problems(shadowed) == [
        "python -m specserve.kernels.cpu_decoder runs in a WORKDIR holding the source: it imports "
        "that copy and builds the libraries outside the venv (use python -P)"]
    explicit = shadowed.replace("python -m specserve.kernels.cpu_decoder",
                                "python -m specserve.kernels.cpu_decoder /opt/venv/lib/python3.11/site-packages/x")
    assert cpu_problems(explicit) == []
    no_gcc = text.replace("gcc libc6-dev", "ca-certificates")
    assert cpu_problems(no_gcc) == ["the fused CPU decoder is built before gcc and libc6-dev are installed"]
