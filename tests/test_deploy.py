"""The container deployment (deploy/Dockerfile, deploy/compose.yaml, deploy/.env.example, .dockerignore) keeps the
seed's operator contract: read-only weights, kernel caches that survive recreation, healthy only when ready, no
restart loop, no privileges, loopback by default, and exactly the service's settings reaching the container.

No Docker daemon is needed: the files are read and parsed. A new setting without a pass-through, or an H3_* name
that is not a setting, fails here before it fails at a container's start."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from h3serve.cli import main
from h3serve.settings import LOOPBACK_HOSTS, Settings, env_name, load_settings

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE = DEPLOY / "compose.yaml"
ENV_EXAMPLE = DEPLOY / ".env.example"
SERVICE = "h3serve"

# The settings whose values are the image's own paths: compose sets them, the host does not pass them.
FIXED = {env_name(name) for name in ("model", "cache_dir", "output_dir")}
SETTINGS = {env_name(name) for name in Settings.model_fields}
PASSED = SETTINGS - FIXED

H3_NAME = re.compile(r"\bH3_[A-Z0-9_]+")
# ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?message}, ${VAR?message}
VAR_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")
ASSIGNMENT = re.compile(r"^(#\s?)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


# ---- parsing helpers -------------------------------------------------------------------------------------------
def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined and comments dropped."""
    out, buf = [], ""
    for line in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        s = line.strip()
        if not s or s.startswith("#"):  # Docker drops comment and empty lines, also inside a continuation
            continue
        if s.endswith("\\"):
            buf += s[:-1] + " "
            continue
        keyword, _, rest = (buf + s).partition(" ")
        out.append((keyword.upper(), rest.strip()))
        buf = ""
    assert not buf, "the Dockerfile ends inside a continuation line"
    return out


def dockerfile_args(global_only: bool = False) -> dict[str, str]:
    args: dict[str, str] = {}
    for keyword, rest in dockerfile():
        if keyword == "FROM" and global_only:
            break
        if keyword == "ARG":
            name, _, default = rest.partition("=")
            args[name.strip()] = shlex.split(default)[0] if default.strip() else ""
    return args


def dockerfile_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, rest in dockerfile():
        if keyword == "ENV":
            for token in shlex.split(rest):
                name, sep, value = token.partition("=")
                assert sep, f"ENV {rest!r}: use the NAME=value form"
                env[name] = value
    return env


def exec_form(instruction: str) -> list[str]:
    """The JSON (exec) form of the single `instruction` line, e.g. ENTRYPOINT."""
    found = [rest for keyword, rest in dockerfile() if keyword == instruction]
    assert len(found) == 1, f"expected exactly one {instruction}, found {len(found)}"
    value = json.loads(found[0])
    assert isinstance(value, list), f"{instruction} must use the exec form (a JSON list)"
    return value


def healthcheck_instruction() -> tuple[dict[str, str], list[str]]:
    found = [rest for keyword, rest in dockerfile() if keyword == "HEALTHCHECK"]
    assert len(found) == 1, f"expected exactly one HEALTHCHECK, found {len(found)}"
    options_text, sep, command = found[0].partition("CMD ")
    assert sep, "HEALTHCHECK must run a command (HEALTHCHECK NONE disables it)"
    options = dict(opt.removeprefix("--").split("=", 1) for opt in options_text.split())
    return options, json.loads(command)


def seconds(duration: str | int) -> float:
    """A Docker/Compose duration (30s, 20m, 1m30s, 1h) in seconds."""
    if isinstance(duration, int):
        return float(duration)
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|ns|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"not a duration: {duration!r}"
    unit = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
    return sum(float(n) * unit[u] for n, u in parts)


def size_bytes(size: str | int) -> int:
    if isinstance(size, int):
        return size
    number, unit = re.fullmatch(r"(\d+)\s*([kmg]?)b?", size.lower()).groups()
    return int(number) * 1024 ** " kmg".index(unit or " ")


def compose_text() -> str:
    """compose.yaml without its comment lines (their ${...} examples are not interpolated)."""
    lines = COMPOSE.read_text(encoding="utf-8").splitlines()
    return "\n".join(line for line in lines if not line.lstrip().startswith("#"))


def compose_vars() -> dict[str, tuple[str | None, str | None]]:
    """Every variable compose.yaml interpolates: {name: (operator, default or message)}."""
    return {m.group(1): (m.group(2), m.group(3)) for m in VAR_REF.finditer(compose_text())}


def unquote(value: str) -> str:
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def env_example() -> tuple[dict[str, str], dict[str, str]]:
    """(uncommented assignments, commented-out assignments) of .env.example; a name twice is an error."""
    live: dict[str, str] = {}
    commented: dict[str, str] = {}
    for line in ENV_EXAMPLE.read_text(encoding="utf-8").splitlines():
        m = ASSIGNMENT.match(line.strip())
        if m is None:
            continue
        target = commented if m.group(1) else live
        name = m.group(2)
        assert name not in live and name not in commented, f".env.example assigns {name} twice"
        target[name] = unquote(m.group(3))
    return live, commented


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def service(compose) -> dict:
    assert set(compose["services"]) == {SERVICE}, "one service, h3serve"
    return compose["services"][SERVICE]


def mounts(service: dict) -> dict[str, dict]:
    """The service's volumes by container path, normalized from the long or the short syntax."""
    out: dict[str, dict] = {}
    for entry in service.get("volumes", []):
        if isinstance(entry, str):  # source:target[:mode]; a ${VAR:?msg} source holds colons of its own
            masked = VAR_REF.sub(lambda m: "${" + m.group(1) + "}", entry)
            source, target, *mode = masked.split(":")
            kind = "bind" if source[:1] in "/.~$" else "volume"
            entry = {"type": kind, "source": source, "target": target, "read_only": "ro" in ",".join(mode)}
        assert entry["target"] not in out, f"{entry['target']} is mounted twice"
        out[entry["target"]] = entry
    return out


def environment(service: dict) -> tuple[set[str], dict[str, str]]:
    """(names passed through from the host, names set to a value) of the service's environment."""
    env = service.get("environment", [])
    passed: set[str] = set()
    fixed: dict[str, str] = {}
    items = env.items() if isinstance(env, dict) else [(e.partition("=")[0], e.partition("=")[2] or None) for e in env]
    for name, value in items:
        assert name not in passed and name not in fixed, f"environment lists {name} twice"
        if value is None:
            passed.add(name)
        else:
            fixed[name] = str(value)
    return passed, fixed


def default_text(name: str) -> str:
    """A setting's default as .env.example writes it (empty when unset)."""
    default = Settings.model_fields[name].default
    if default is None:
        return ""
    if isinstance(default, bool):
        return "true" if default else "false"
    return str(default)


# ---- compose: mounts -------------------------------------------------------------------------------------------
def test_the_service_is_built_from_the_dockerfile_under_a_pinned_image_name(service):
    build = service["build"]
    assert (COMPOSE.parent / build["context"]).resolve() == ROOT, "the build context is the repository root"
    assert (ROOT / build["dockerfile"]).resolve() == DOCKERFILE
    name, op, default = VAR_REF.fullmatch(service["image"]).groups()
    assert not name.startswith("H3_") and op == ":-", "the image name comes from a variable with a default"
    tag = default.rpartition(":")[2]
    assert "/" not in tag and tag != "latest" and re.search(r"\d", tag), f"pin the image tag, got {default!r}"


def test_the_build_argument_defaults_are_the_dockerfiles(service):
    args = dockerfile_args()
    for arg, value in service["build"]["args"].items():
        assert arg in args, f"build arg {arg} is not an ARG of the Dockerfile"
        m = VAR_REF.fullmatch(value)
        assert m and m.group(2) == ":-", f"build arg {arg}: ${{VAR:-default}}, so an unset VAR keeps the default"
        assert m.group(3) == args[arg], f"build arg {arg}: compose's default {m.group(3)!r}, Dockerfile's {args[arg]!r}"


def test_the_model_is_mounted_read_only_where_the_image_looks_for_it(service):
    target = dockerfile_env()["H3_MODEL"]
    mount = mounts(service).get(target)
    assert mount is not None, f"nothing is mounted at the image's H3_MODEL {target}"
    assert mount["type"] == "bind" and mount.get("read_only") is True, "the checkpoint is mounted read-only"
    name = VAR_REF.search(mount["source"]).group(1)
    assert not name.startswith("H3_"), f"{name}: an H3_ name would reach the settings"
    assert mount.get("bind", {}).get("create_host_path", True) is False, "a missing model folder must fail, not be made"


def test_the_kernel_caches_live_in_a_named_volume_at_the_image_h3_cache_dir(compose, service):
    target = dockerfile_env()["H3_CACHE_DIR"]
    mount = mounts(service).get(target)
    assert mount is not None, f"nothing is mounted at the image's H3_CACHE_DIR {target}"
    assert mount["type"] == "volume" and not mount.get("read_only"), "a writable named volume"
    assert mount["source"] in (compose.get("volumes") or {}), f"volume {mount['source']} is not declared"


def test_the_output_is_mounted_writable_at_the_image_h3_output_dir(service):
    target = dockerfile_env()["H3_OUTPUT_DIR"]
    mount = mounts(service).get(target)
    assert mount is not None, f"nothing is mounted at the image's H3_OUTPUT_DIR {target}"
    assert not mount.get("read_only"), "the job database and MP4s are written there"
    assert target not in {dockerfile_env()["H3_MODEL"], dockerfile_env()["H3_CACHE_DIR"]}


# ---- compose: the environment ----------------------------------------------------------------------------------
def test_every_setting_but_the_fixed_paths_is_passed_through_by_name(service):
    passed, _ = environment(service)
    assert not PASSED - passed, f"settings the container never receives: {sorted(PASSED - passed)}"
    assert not passed - PASSED, f"passed through but not a setting (or a fixed path): {sorted(passed - PASSED)}"
    assert "env_file" not in service, "env_file would pass every .env line, typos and compose-only names included"


def test_the_fixed_paths_are_the_image_paths_that_compose_mounts(service):
    _, fixed = environment(service)
    image = dockerfile_env()
    assert set(fixed) == FIXED, f"set to a value in compose: {sorted(fixed)}; expected exactly {sorted(FIXED)}"
    for name in FIXED:
        assert fixed[name] == image[name], f"{name}: compose {fixed[name]}, image {image[name]}"
        assert fixed[name] in mounts(service), f"{name}={fixed[name]} is not a mount target"


@pytest.mark.parametrize("path", [COMPOSE, ENV_EXAMPLE, DOCKERFILE], ids=lambda p: p.name)
def test_no_h3_name_that_is_not_a_setting(path):
    names = set(H3_NAME.findall(path.read_text(encoding="utf-8")))
    assert names, f"{path.name} names no setting at all"
    assert names <= SETTINGS, f"{path.name}: not settings (the server refuses them): {sorted(names - SETTINGS)}"


def test_compose_host_variables_are_not_h3_names_and_are_documented(compose):
    variables = compose_vars()
    assert variables, "compose.yaml interpolates no variable (no model folder?)"
    live, commented = env_example()
    for name, (op, default) in variables.items():
        assert not name.startswith("H3_"), f"${{{name}}}: H3_ names are settings; compose-only variables are not"
        assert name in live or name in commented, f"{name} is not in .env.example"
        if op == ":-":
            assert commented.get(name, live.get(name)) == default, f"{name}: .env.example's default is not compose's"


# ---- compose: runtime properties -------------------------------------------------------------------------------
def test_healthy_only_when_ready(service):
    check = service["healthcheck"]
    assert check["test"] in (["CMD", "h3serve", "ready"], "CMD-SHELL h3serve ready", "h3serve ready")
    assert not check.get("disable")
    assert seconds(check["start_period"]) >= 10 * 60, "loading and warmup took ~9 min on a Spark"


def test_no_privileges(service):
    assert not service.get("privileged"), "no privileged mode"
    assert not service.get("cap_add")
    user = service.get("user")
    assert user is None or str(user).split(":")[0] not in ("0", "root"), f"user {user}: the image's uid, not root"
    assert "host" not in (service.get("ipc"), service.get("pid"))
    assert "devices" not in service, "the GPU comes through the NVIDIA runtime, not raw device nodes"


def test_no_restart_policy(service):
    # Quoted on purpose: YAML 1.1 reads a bare `no` as false.
    assert service.get("restart") == "no", "a failed start must stay stopped, not reload the weights in a loop"
    assert "restart_policy" not in (service.get("deploy") or {})


def test_gpu_access_is_requested(service):
    devices = (((service.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices") or []
    by_deploy = any("gpu" in d.get("capabilities", []) and d.get("driver") == "nvidia" for d in devices)
    assert by_deploy or service.get("gpus"), "no GPU requested (gpus: or deploy.resources.reservations.devices)"


def test_host_network_so_the_default_loopback_bind_works(service):
    assert Settings.model_fields["bind_host"].default in LOOPBACK_HOSTS
    assert service.get("network_mode") == "host"
    assert "ports" not in service, "ports do not apply with host networking"


def test_graceful_stop_and_modest_shm(service):
    assert seconds(service["stop_grace_period"]) >= 60, "the server stops its jobs gracefully (uvicorn waits 30 s)"
    assert 64 * 2**20 <= size_bytes(service["shm_size"]) <= 2 * 2**30, "shm comes out of GB10's unified memory"


# ---- the Dockerfile --------------------------------------------------------------------------------------------
def test_the_base_image_is_pinned_by_version():
    args = dockerfile_args(global_only=True)
    froms = [rest for keyword, rest in dockerfile() if keyword == "FROM"]
    assert froms
    for ref in froms:
        ref = re.sub(r"\$\{?(\w+)\}?", lambda m: args[m.group(1)], ref.split()[0])
        name, _, digest = ref.partition("@")
        repo, _, tag = name.rpartition(":")
        assert repo and "/" not in tag, f"FROM {ref}: no tag"
        assert tag != "latest" and re.match(r"\d+\.\d+\.\d+", tag), f"FROM {ref}: pin an explicit version"
        assert not digest or re.fullmatch(r"sha256:[0-9a-f]{64}", digest)


def test_torch_is_pinned_and_matches_the_base_images_cuda():
    args = dockerfile_args()
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["TORCH_VERSION"]), "pin torch to one release"
    runs = " ".join(rest for keyword, rest in dockerfile() if keyword == "RUN")
    assert '"torch==${TORCH_VERSION}"' in runs or "torch==${TORCH_VERSION} " in runs
    major, minor = re.search(r":(\d+)\.(\d+)\.", args["CUDA_IMAGE"]).groups()
    assert args["TORCH_INDEX_URL"].rstrip("/").endswith(f"/cu{major}{minor}"), "torch's CUDA build = the base's"
    assert args["H3SERVE_EXTRAS"] == "", "extras are opt-in (humming needs a -devel base)"


def test_it_runs_as_a_fixed_unprivileged_user():
    instructions = dockerfile()
    entry = max(i for i, (keyword, _) in enumerate(instructions) if keyword == "ENTRYPOINT")
    users = [(i, rest) for i, (keyword, rest) in enumerate(instructions) if keyword == "USER"]
    assert users and users[-1][0] < entry, "USER must be set before the ENTRYPOINT"
    user = users[-1][1].split(":")[0]
    assert user not in ("root", "0") and user.isdigit(), f"USER {user}: a fixed non-root uid"


def test_the_entrypoint_serves_and_the_healthcheck_asks_ready():
    assert exec_form("ENTRYPOINT") == ["h3serve", "serve"]
    options, command = healthcheck_instruction()
    assert command == ["h3serve", "ready"]
    assert seconds(options["start-period"]) >= 10 * 60
    assert seconds(options["timeout"]) >= 10, "a probe starts Python and imports torch"


def test_the_image_paths_and_no_secrets():
    env = dockerfile_env()
    assert {name for name in env if name.startswith("H3_")} == FIXED, "the image sets only the three paths"
    assert all(env[name].startswith("/") for name in FIXED)
    secret = re.compile(r"KEY|TOKEN|SECRET|PASSWORD", re.IGNORECASE)
    baked = [n for n in [*env, *dockerfile_args()] if secret.search(n)]
    assert not baked, f"secrets must not be baked into the image: {baked}"


# ---- .env.example ----------------------------------------------------------------------------------------------
def test_the_env_example_lists_every_setting():
    text = ENV_EXAMPLE.read_text(encoding="utf-8")
    missing = [name for name in sorted(SETTINGS) if not re.search(rf"\b{name}\b", text)]
    assert not missing, f".env.example does not mention {missing}"
    assert "chmod 600" in text and "openssl rand -hex 32" in text


def test_the_env_example_assigns_each_passed_setting_its_default():
    live, commented = env_example()
    assigned = {name: value for name, value in {**commented, **live}.items() if name.startswith("H3_")}
    assert set(assigned) == PASSED, (
        f"missing: {sorted(PASSED - set(assigned))}; not passed by compose: {sorted(set(assigned) - PASSED)}"
    )
    for name, value in commented.items():
        if name.startswith("H3_"):
            field = name.removeprefix("H3_").lower()
            assert value == default_text(field), f"{name}={value}: the default is {default_text(field)!r}"


def test_the_env_example_loads_as_it_is_and_uncommented(monkeypatch):
    for var in list(os.environ):
        if var.startswith("H3_"):
            monkeypatch.delenv(var)
    live, commented = env_example()
    as_is = {name: value for name, value in live.items() if name.startswith("H3_")}
    load_settings(env=as_is)
    uncommented = {name: value for name, value in {**commented, **live}.items() if name.startswith("H3_")}
    settings = load_settings(env=uncommented)
    assert settings.bind_host in LOOPBACK_HOSTS and settings.key is None


# ---- what never reaches Git or the image -----------------------------------------------------------------------
def output_dir_in_repo() -> str:
    op, default = compose_vars()["H3SERVE_OUTPUT_DIR"]
    assert op == ":-" and default, "the output folder needs a default"
    return (COMPOSE.parent / default).resolve().relative_to(ROOT).as_posix()


def test_env_and_output_are_git_ignored(tmp_path):
    git = shutil.which("git")
    if git is None:
        pytest.skip("git is not installed")
    # A scratch repository with only our .gitignore: the user's global excludes must not make this pass.
    shutil.copy(ROOT / ".gitignore", tmp_path / ".gitignore")
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    subprocess.run([git, "init", "-q", str(tmp_path)], check=True, env=env)
    output = output_dir_in_repo()
    paths = [".env", "deploy/.env", f"{output}/jobs.db", f"{output}/job-1.mp4", "output/jobs.db"]
    not_ignored = [
        p for p in paths if subprocess.run([git, "check-ignore", "-q", p], cwd=tmp_path, env=env).returncode != 0
    ]
    assert not not_ignored, f".gitignore does not ignore {not_ignored} (secrets and media must never be committed)"


def dockerignore_rules() -> list[tuple[bool, re.Pattern]]:
    """.dockerignore as (negated, regex) rules: * within a path segment, ** across segments, ? one character."""
    rules = []
    for line in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = line.removeprefix("!").strip().strip("/")
        parts = re.split(r"(\*\*/|\*\*|\*|\?)", pattern)
        regex = {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}
        rules.append((negated, re.compile("".join(regex.get(p, re.escape(p)) for p in parts) + r"\Z")))
    return rules


def dockerignored(path: str, rules) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parent folders decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for negated, regex in rules:
        if any(regex.match(prefix) for prefix in prefixes):
            ignored = not negated
    return ignored


def test_the_build_context_holds_the_package_and_no_secrets_or_media():
    rules = dockerignore_rules()
    output = output_dir_in_repo()
    kept_out = [
        ".env",
        "deploy/.env",
        f"{output}/jobs.db",
        "output/job-1.mp4",
        "FL2VA/transformer/diffusion_pytorch_model.safetensors",
        ".venv/bin/python",
        ".git/config",
        "src/h3serve/__pycache__/cli.cpython-312.pyc",
    ]
    leaked = [p for p in kept_out if not dockerignored(p, rules)]
    assert not leaked, f".dockerignore lets these into the build context: {leaked}"
    sources = []
    for keyword, rest in dockerfile():
        if keyword in ("COPY", "ADD") and "--from" not in rest:
            sources += [s for s in rest.split()[:-1] if not s.startswith("--")]
    assert sources, "the Dockerfile copies nothing from the repository"
    for source in sources:
        files = [ROOT / source] if (ROOT / source).is_file() else (ROOT / source).rglob("*.py")
        for file in files:
            relative = file.relative_to(ROOT).as_posix()
            if "__pycache__" not in relative and ".egg-info" not in relative:
                assert not dockerignored(relative, rules), f"{relative} is needed by the build but .dockerignored"


# ---- the commands the deployment relies on ---------------------------------------------------------------------
def test_the_healthcheck_command_is_an_installed_script():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
    assert scripts.get("h3serve") == "h3serve.cli:main"


@pytest.mark.parametrize(
    ("argv", "word"),
    [(["ready", "--help"], "ready"), (["check", "--help"], "--preflight")],
    ids=["h3serve ready", "h3serve check --preflight"],
)
def test_the_commands_the_deployment_documents_exist(argv, word, capsys):
    """The image's healthcheck (`h3serve ready`) and the documented preflight (`h3serve check --preflight`) exist: a
    CLI without them fails here (argparse exits 2 on an unknown command), not only at a container's start."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    assert word in capsys.readouterr().out
