"""The fleet's deployment files (issue 58, item 5; docs/fleet.md, "Deployment"): deploy/compose.fleet.yaml (two GPU
servers, PostgreSQL, an S3 server, Caddy in front: deploy/Caddyfile.fleet, deploy/fleet.env.example) and the Kubernetes
manifests in deploy/k8s/. No Docker daemon and no cluster: the files are read and parsed, and checked against the
code they deploy (the settings schema, the app's routes, `h3serve ready`, the Dockerfile, the server's drain on
SIGTERM). Where Caddy is installed, its own parser validates the proxy's configuration."""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

import h3serve.cli.serve
from h3serve.cli import main
from h3serve.service.app import open_routes, routes
from h3serve.service.scheduler import Scheduler
from h3serve.settings import LOOPBACK_HOSTS, SERVER_ID, Settings, load_settings
from service_fixtures import live_server, settings
from test_deploy import DOCKERFILE, H3_NAME, SETTINGS, VAR_REF, dockerfile, dockerfile_args, dockerfile_env, seconds

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
FLEET = DEPLOY / "compose.fleet.yaml"
CADDYFILE = DEPLOY / "Caddyfile.fleet"
FLEET_ENV = DEPLOY / "fleet.env.example"
ENV_EXAMPLE = DEPLOY / ".env.example"
K8S = DEPLOY / "k8s"
SERVERS = ("gpu-0", "gpu-1")
KEY = "k" * 40  # a well-formed API key for loading the settings (32+ safe characters)

# The settings the fleet's compose file sets to values (the image's paths, the store and bucket on its network, a bind
# the proxy reaches, each server's name), and those it deliberately does not pass (one GPU per server, one host per
# server, no signed URLs naming an endpoint only the compose network reaches). Every other setting is passed by name.
FLEET_FIXED = {"H3_MODEL", "H3_CACHE_DIR", "H3_OUTPUT_DIR", "H3_STORE", "H3_OUTPUT_URL", "H3_S3_ENDPOINT",
               "H3_BIND_HOST", "H3_API_PORT", "H3_ALLOW_REMOTE_API", "H3_SERVER_ID"}  # fmt: skip
FLEET_NOT_PASSED = {"H3_DEVICE", "H3_NUM_GPUS", "H3_S3_PRESIGN", "H3_NNODES", "H3_NODE_RANK", "H3_DIST_INIT_ADDR",
                    "H3_ALLOW_REMOTE_NODES", "H3_NODE_KEY", "H3_NODE_KEY_FILE", "H3_NODE_TIMEOUT",
                    "H3_NODE_GRACE"}  # fmt: skip


# ---- reading the files ---------------------------------------------------------------------------------------------
def assignments(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(uncommented NAME=value lines, commented-out ones) of an env file."""
    live: dict[str, str] = {}
    commented: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        m = re.match(r"^(#\s?)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$", line.strip())
        if m:
            (commented if m.group(1) else live)[m.group(2)] = m.group(3).strip()
    return live, commented


def fleet_text() -> str:
    lines = FLEET.read_text(encoding="utf-8").splitlines()
    return "\n".join(line for line in lines if not line.lstrip().startswith("#"))


def interpolate(text: str, values: dict[str, str]) -> str:
    """Compose's interpolation: ${VAR:-default} and ${VAR-default} take the default when VAR is not in `values`;
    ${VAR:?message} needs VAR; ${VAR} is empty without it."""

    def value(m: re.Match) -> str:
        name, op, rest = m.groups()
        if name in values:
            return values[name]
        assert op not in (":?", "?"), f"${{{name}}} is required: {rest}"
        return rest if op in (":-", "-") else ""

    return VAR_REF.sub(value, text)


REQUIRED = {name: f"x{name.lower()}x" for name in ("H3SERVE_DB_PASSWORD", "H3SERVE_S3_ACCESS_KEY",
                                                    "H3SERVE_S3_SECRET_KEY", "H3SERVE_MODEL_DIR")}  # fmt: skip


@pytest.fixture(scope="module")
def fleet() -> dict:
    """compose.fleet.yaml as Compose resolves it with the required variables set and the others at their defaults."""
    return yaml.safe_load(interpolate(fleet_text(), REQUIRED))


def environment(service: dict) -> tuple[set[str], dict[str, str]]:
    """(names passed through, {name: value} set) of a service whose environment is a mapping."""
    env = service.get("environment") or {}
    assert isinstance(env, dict), "the fleet's environments are mappings (so the shared part can be merged in)"
    return {k for k, v in env.items() if v is None}, {k: str(v) for k, v in env.items() if v is not None}


def caddy_tokens() -> list[list[str]]:
    """The Caddyfile's lines as tokens (comments dropped; `backtick` and "double" quoted tokens kept whole)."""
    out = []
    for line in CADDYFILE.read_text(encoding="utf-8").splitlines():
        tokens = re.findall(r"`[^`]*`|\"(?:\\.|[^\"])*\"|[^\s#]+|#.*", line)
        tokens = [t for t in tokens if not t.startswith("#")]
        if tokens:
            out.append(tokens)
    return out


def caddy_directive(name: str) -> list[list[str]]:
    """Every line of the Caddyfile that starts with `name`: its arguments."""
    return [tokens[1:] for tokens in caddy_tokens() if tokens[0] == name]


def k8s_documents() -> dict[str, dict]:
    """Every manifest in deploy/k8s (but the kustomization), by "Kind/name"."""
    docs: dict[str, dict] = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            key = f"{doc['kind']}/{doc['metadata']['name']}"
            assert key not in docs, f"{key} twice"
            docs[key] = doc
    return docs


@pytest.fixture(scope="module")
def k8s() -> dict[str, dict]:
    return k8s_documents()


@pytest.fixture(scope="module")
def pod(k8s) -> dict:
    return k8s["StatefulSet/h3serve"]["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def container(pod) -> dict:
    (c,) = pod["containers"]
    return c


def get_routes(router) -> set[str]:
    return {r.path for r in router.routes if "GET" in (getattr(r, "methods", None) or ())}


def drain_s() -> float:
    """How long `serve` may take to stop on SIGTERM: uvicorn's wait for open requests, then the scheduler's stop (the
    jobs given back, the threads joined), as the code sets them."""
    source = inspect.getsource(h3serve.cli.serve)
    (graceful,) = re.findall(r"timeout_graceful_shutdown=(\d+(?:\.\d+)?)", source)
    stop = inspect.signature(Scheduler.stop).parameters["timeout"].default
    return float(graceful) + float(stop)


def image_user() -> int:
    users = [rest for keyword, rest in dockerfile() if keyword == "USER"]
    return int(users[-1].split(":")[0])


# ---- compose: the services ------------------------------------------------------------------------------------------
def test_the_fleet_is_two_gpu_servers_a_database_an_s3_server_and_a_proxy(fleet):
    assert set(fleet["services"]) == {*SERVERS, "db", "s3", "s3-bucket", "proxy"}


@pytest.mark.parametrize("name", SERVERS)
def test_each_server_is_the_dockerfiles_image_with_the_fleet_extra(fleet, name):
    service = fleet["services"][name]
    assert (FLEET.parent / service["build"]["context"]).resolve() == ROOT
    assert (ROOT / service["build"]["dockerfile"]).resolve() == DOCKERFILE
    assert "command" not in service and "entrypoint" not in service, "the image's ENTRYPOINT serves"
    args = dockerfile_args()
    for arg, value in service["build"]["args"].items():
        assert arg in args, f"build arg {arg} is not an ARG of the Dockerfile"
        if arg != "H3SERVE_EXTRAS":
            assert value == args[arg], f"{arg}: the fleet's default {value!r}, the Dockerfile's {args[arg]!r}"
    extras = service["build"]["args"]["H3SERVE_EXTRAS"].split(",")
    fleet_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["fleet"]
    assert (
        "fleet" in extras
        and any(d.startswith("psycopg") for d in fleet_extra)
        and any(d.startswith("boto3") for d in fleet_extra)
    ), "H3_STORE needs psycopg and H3_OUTPUT_URL boto3: the image needs the fleet extra"
    tag = service["image"].rpartition(":")[2]
    assert tag != "latest" and re.search(r"\d", tag) and "fleet" in tag, f"a pinned tag of its own: {service['image']}"


def test_the_servers_differ_only_in_their_name_and_gpu(fleet):
    a, b = (fleet["services"][name] for name in SERVERS)
    env_a, env_b = (dict(s["environment"]) for s in (a, b))
    assert env_a.pop("H3_SERVER_ID") == "gpu-0" and env_b.pop("H3_SERVER_ID") == "gpu-1"
    assert env_a == env_b, "the same settings: servers claim each other's jobs only with the same build"
    devices = []
    for service in (a, b):
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"] and "count" not in device
        assert len(device["device_ids"]) == 1, "one GPU each"
        devices.append(device["device_ids"][0])
    assert devices[0] != devices[1], "each server its own GPU"
    sources = [{m["target"]: m["source"] for m in s["volumes"]} for s in (a, b)]
    image = dockerfile_env()
    for path in (image["H3_CACHE_DIR"], image["H3_OUTPUT_DIR"]):
        assert sources[0][path] != sources[1][path], f"{path}: a volume of each server's own"
    assert sources[0][image["H3_MODEL"]] == sources[1][image["H3_MODEL"]], "one checkpoint folder"


@pytest.mark.parametrize("name", SERVERS)
def test_each_server_gets_exactly_the_settings_and_no_name_that_is_not_one(fleet, name):
    passed, fixed = environment(fleet["services"][name])
    h3 = {n for n in passed | set(fixed) if n.startswith("H3_")}
    assert h3 <= SETTINGS, f"not settings (the server refuses them): {sorted(h3 - SETTINGS)}"
    assert {n for n in fixed if n.startswith("H3_")} == FLEET_FIXED
    assert passed == SETTINGS - FLEET_FIXED - FLEET_NOT_PASSED, (
        f"missing: {sorted(SETTINGS - FLEET_FIXED - FLEET_NOT_PASSED - passed)}; "
        f"extra: {sorted(passed - (SETTINGS - FLEET_FIXED - FLEET_NOT_PASSED))}"
    )
    image = dockerfile_env()
    for path in ("H3_MODEL", "H3_CACHE_DIR", "H3_OUTPUT_DIR"):
        assert fixed[path] == image[path]
    mounts = {m["target"]: m for m in fleet["services"][name]["volumes"]}
    assert set(mounts) == {image[p] for p in ("H3_MODEL", "H3_CACHE_DIR", "H3_OUTPUT_DIR")}
    assert mounts[image["H3_MODEL"]]["read_only"] is True
    assert mounts[image["H3_MODEL"]]["bind"]["create_host_path"] is False


@pytest.mark.parametrize("name", SERVERS)
def test_the_fleet_settings_load_and_name_this_composes_database_and_bucket(fleet, name, monkeypatch):
    for var in [v for v in os.environ if v.startswith("H3_")]:
        monkeypatch.delenv(var)
    _, fixed = environment(fleet["services"][name])
    h3 = {n: v for n, v in fixed.items() if n.startswith("H3_")}
    s = load_settings(env={**h3, "H3_API_KEY": KEY})
    assert s.store.startswith("postgresql://") and s.output_url.startswith("s3://")
    assert s.bind_host not in LOOPBACK_HOSTS and s.allow_remote_api and SERVER_ID.fullmatch(s.server_id)
    store = urlsplit(s.store)
    db = fleet["services"]["db"]
    assert (store.hostname, store.port) == ("db", 5432)
    assert store.username == db["environment"]["POSTGRES_USER"] and store.path == "/" + db["environment"]["POSTGRES_DB"]
    assert fixed["PGPASSWORD"] == db["environment"]["POSTGRES_PASSWORD"], "the servers' password is the database's"
    endpoint = urlsplit(s.s3_endpoint)
    command = fleet["services"]["s3"]["command"]
    assert endpoint.hostname == "s3" and f":{endpoint.port}" == command[command.index("--addr") + 1]
    bucket = urlsplit(s.output_url).hostname
    assert fleet["services"]["s3-bucket"]["command"][:2] == ["mkdir", f"/data/{bucket}"], "the bucket is made"
    assert f":s3:{bucket}" in fleet["services"]["s3"]["healthcheck"]["test"]
    auth = fleet["services"]["s3"]["environment"]["RCLONE_AUTH_KEY"]
    assert auth == f'"{fixed["AWS_ACCESS_KEY_ID"]},{fixed["AWS_SECRET_ACCESS_KEY"]}"', "the servers use the S3 key"
    with pytest.raises(Exception, match="H3_API_KEY"):  # why .env must hold a key: refused without one
        load_settings(env=h3)


@pytest.mark.parametrize("name", SERVERS)
def test_each_server_starts_after_a_healthy_database_and_s3_and_is_healthy_when_ready(fleet, name):
    service = fleet["services"][name]
    assert service["depends_on"] == {"db": {"condition": "service_healthy"}, "s3": {"condition": "service_healthy"}}
    assert service["healthcheck"]["test"] == ["CMD", "h3serve", "ready"]
    assert seconds(service["healthcheck"]["start_period"]) >= 10 * 60
    assert service["restart"] == "no" and service["init"] is True
    assert seconds(service["stop_grace_period"]) >= drain_s(), "the server's drain on SIGTERM must fit"
    assert "ports" not in service and service.get("network_mode") != "host", "reached through the proxy only"
    assert service["cap_drop"] == ["ALL"] and "no-new-privileges:true" in service["security_opt"]


def test_the_database_and_the_s3_server(fleet):
    db, s3, bucket = (fleet["services"][n] for n in ("db", "s3", "s3-bucket"))
    for service in (db, s3, bucket, fleet["services"]["proxy"]):
        repo, _, tag = service["image"].rpartition(":")
        assert repo and re.fullmatch(r"\d+\.\d+(\.\d+)?", tag), f"pin the version: {service['image']}"
    assert db["image"].startswith("postgres:"), "the official image"
    assert db["healthcheck"]["test"][:2] == ["CMD", "pg_isready"] and "127.0.0.1" in db["healthcheck"]["test"]
    assert [m["target"] for m in db["volumes"]] == ["/var/lib/postgresql/data"] and db["volumes"][0]["type"] == "volume"
    assert s3["depends_on"] == {"s3-bucket": {"condition": "service_completed_successfully"}}
    assert s3["command"][:3] == ["serve", "s3", "/data"] and s3["healthcheck"]["test"][0] == "CMD"
    assert [m["source"] for m in s3["volumes"]] == [m["source"] for m in bucket["volumes"]], "one data volume"
    declared = set(fleet["volumes"])
    for service in fleet["services"].values():
        for m in service.get("volumes", []):
            assert m["type"] == "bind" or m["source"] in declared, f"volume {m['source']} is not declared"


# ---- compose: the proxy ---------------------------------------------------------------------------------------------
def test_the_proxy_is_the_one_address_and_forwards_to_every_server(fleet):
    proxy = fleet["services"]["proxy"]
    published = [p for s in fleet["services"].values() for p in s.get("ports", [])]
    assert published == proxy["ports"] and len(published) == 1
    host, _, target = published[0].rpartition(":")
    assert host.startswith("127.0.0.1:"), "loopback by default, as a single server's bind"
    (listen,) = [tokens[0] for tokens in caddy_tokens() if tokens[0].startswith(":") and tokens[-1] == "{"]
    assert listen == f":{target}"
    (upstreams,) = caddy_directive("reverse_proxy")
    port = environment(fleet["services"]["gpu-0"])[1]["H3_API_PORT"]
    assert upstreams[:-1] == [f"{name}:{port}" for name in SERVERS], "every server, on its API port"
    assert caddy_directive("lb_policy") == [["round_robin"]]
    (mount,) = proxy["volumes"]
    assert (DEPLOY / mount["source"]).resolve() == CADDYFILE and mount["read_only"] is True
    assert mount["target"] == "/etc/caddy/Caddyfile", "the image's default configuration path"


def test_the_proxy_streams_both_ways_and_waits_as_long_as_a_sync_render():
    names = {tokens[0] for tokens in caddy_tokens()}
    buffering = {"request_buffers", "response_buffers", "buffer_requests", "buffer_responses"} & names
    assert not buffering, f"buffering turned on: {buffering}"
    assert ["-1"] not in caddy_directive("flush_interval"), "-1 keeps a gone client's sync render running"
    assert not {"read_body", "write"} & names, "a whole-request or write deadline would cut long renders and streams"
    longest = Settings.model_fields["video_sync_timeout"].metadata
    longest = max(m.le for m in longest if getattr(m, "le", None) is not None)
    for directive in ("read_timeout", "response_header_timeout"):
        (value,) = caddy_directive(directive)
        assert seconds(value[0]) > longest, f"{directive} {value[0]}: a sync render may be silent {longest} s"


def test_the_proxy_sends_requests_only_to_ready_servers(tmp_path):
    (uri,) = caddy_directive("health_uri")
    assert uri[0] in get_routes(open_routes), f"{uri[0]}: not an unauthenticated route of the app"
    (body,) = caddy_directive("health_body")
    expect = body[0].strip("`")
    with live_server(settings(tmp_path, startup_warmup=True)) as server, server.client() as c:
        text = c.get(uri[0]).text
    assert json.loads(text)["ready"] is True
    assert len(re.findall(expect, text)) == 1, f"{expect!r} must match a ready server's {uri[0]} once: {text[:200]}"
    assert not re.search(expect, text.replace('"ready":true', '"ready":false'))


@pytest.mark.skipif(shutil.which("caddy") is None, reason="caddy is not installed (apt-get install caddy)")
def test_caddy_accepts_the_proxy_configuration():
    done = subprocess.run(["caddy", "adapt", "--config", str(CADDYFILE), "--validate"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    server = json.loads(done.stdout)["apps"]["http"]["servers"]["srv0"]
    assert "read_timeout" not in server and "write_timeout" not in server


# ---- compose: the host variables -------------------------------------------------------------------------------------
def test_the_fleets_host_variables_are_documented_with_their_defaults():
    live, commented = assignments(ENV_EXAMPLE)
    fleet_live, fleet_commented = assignments(FLEET_ENV)
    assert not set(fleet_live) & set(live) and not set(fleet_commented) & set(commented), "a name in both files"
    found = {m.group(1): (m.group(2), m.group(3)) for m in VAR_REF.finditer(fleet_text())}
    assert found
    for name, (op, default) in found.items():
        assert not name.startswith("H3_"), f"${{{name}}}: H3_ names are settings"
        documented = {**commented, **live, **fleet_commented, **fleet_live}
        assert name in documented, f"{name} is in neither .env.example nor fleet.env.example"
        if op == ":-":
            assert documented[name] == default, f"{name}: documented {documented[name]!r}, compose's {default!r}"
        if op == ":?":
            assert name in live or fleet_live.get(name) == "", f"{name} is required: an empty line to fill in"
    text = FLEET_ENV.read_text(encoding="utf-8")
    assert "chmod 600" in text and "openssl rand" in text and "H3_API_KEY" in text


def test_no_h3_name_in_the_fleet_files_that_is_not_a_setting():
    for path in (FLEET, CADDYFILE, FLEET_ENV, *K8S.glob("*.yaml")):
        names = set(H3_NAME.findall(path.read_text(encoding="utf-8")))
        assert names <= SETTINGS, f"{path.name}: not settings: {sorted(names - SETTINGS)}"


# ---- Kubernetes -----------------------------------------------------------------------------------------------------
def test_the_kustomization_lists_every_manifest_and_sets_the_fleet_image(k8s, container):
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text(encoding="utf-8"))
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files
    assert set(k8s) == {"ConfigMap/h3serve-config", "StatefulSet/h3serve", "Service/h3serve",
                        "Service/h3serve-pods", "PodDisruptionBudget/h3serve"}  # fmt: skip
    (image,) = kustomization["images"]
    name, _, tag = container["image"].rpartition(":")
    assert image["name"] == name and image["newTag"] == tag
    compose_image = yaml.safe_load(interpolate(fleet_text(), REQUIRED))["services"]["gpu-0"]["image"]
    assert tag == compose_image.rpartition(":")[2], "the same fleet image as compose.fleet.yaml"


def test_the_pods_run_the_images_entrypoint_as_its_user_with_one_gpu(pod, container):
    assert "command" not in container and "args" not in container, "the image's ENTRYPOINT: h3serve serve"
    assert exec_entrypoint() == ["h3serve", "serve"]
    assert pod["securityContext"]["runAsUser"] == image_user() and pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    image = dockerfile_env()
    for path in ("H3_MODEL", "H3_CACHE_DIR", "H3_OUTPUT_DIR"):
        assert image[path] in mounts, f"nothing mounted at the image's {path}"
    assert mounts[image["H3_MODEL"]].get("readOnly") is True


def exec_entrypoint() -> list[str]:
    (rest,) = [rest for keyword, rest in dockerfile() if keyword == "ENTRYPOINT"]
    return json.loads(rest)


def pod_env(container: dict, k8s: dict) -> dict[str, object]:
    """The container's environment: the ConfigMap's values, then each `env` entry (a value, or its valueFrom)."""
    env: dict[str, object] = {}
    for source in container.get("envFrom", []):
        env.update(k8s[f"ConfigMap/{source['configMapRef']['name']}"]["data"])
    for entry in container.get("env", []):
        env[entry["name"]] = entry.get("value", entry.get("valueFrom"))
    return env


def test_the_server_name_is_the_pods_and_the_secrets_come_from_secrets(k8s, container):
    env = pod_env(container, k8s)
    assert env["H3_SERVER_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    sts = k8s["StatefulSet/h3serve"]
    for ordinal in (0, sts["spec"]["replicas"] - 1, 99):
        assert SERVER_ID.fullmatch(f"{sts['metadata']['name']}-{ordinal}"), "a pod's name must be a server name"
    for name in ("H3_STORE", "PGPASSWORD", "H3_API_KEY", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert "secretKeyRef" in env[name], f"{name} must come from a Secret"
    secret = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|STORE", re.IGNORECASE)
    data = k8s["ConfigMap/h3serve-config"]["data"]
    assert not [n for n in data if secret.search(n)], "no secret in the ConfigMap"


def k8s_settings_env(container: dict, k8s: dict) -> dict[str, str]:
    env = pod_env(container, k8s)
    values = {"H3_SERVER_ID": "h3serve-0", "H3_STORE": "postgresql://h3@db.example:5432/h3jobs", "H3_API_KEY": KEY}
    return {n: (values[n] if isinstance(v, dict) else str(v)) for n, v in env.items() if n.startswith("H3_")}


def test_the_pods_settings_load_as_a_fleet(k8s, container, monkeypatch):
    for var in [v for v in os.environ if v.startswith("H3_")]:
        monkeypatch.delenv(var)
    s = load_settings(env=k8s_settings_env(container, k8s))
    assert s.store.startswith("postgresql://") and s.output_url.startswith("s3://") and s.server_id == "h3serve-0"
    assert s.bind_host not in LOOPBACK_HOSTS and s.allow_remote_api and s.key == KEY
    (port,) = container["ports"]
    assert port["containerPort"] == s.api_port and port["name"] == "http"


def test_the_probes_ask_the_apps_health_and_ready_routes(k8s, container, monkeypatch, capsys):
    for probe in ("startupProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] in get_routes(open_routes), f"{probe}: {get['path']} is no unauthenticated route"
        assert get["port"] == container["ports"][0]["name"]
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 15 * 60, "loading takes minutes"
    command = container["readinessProbe"]["exec"]["command"]
    assert command[:2] == ["h3serve", "ready"]
    # What `h3serve ready` asks, with this pod's settings: /ready on its port, with its key.
    for var in [v for v in os.environ if v.startswith("H3_")]:
        monkeypatch.delenv(var)
    for name, value in k8s_settings_env(container, k8s).items():
        monkeypatch.setenv(name, value)
    asked = []

    class Answer:
        status_code, text = 200, '{"ready": true}'

    monkeypatch.setattr("httpx.get", lambda url, headers, timeout: asked.append((url, headers, timeout)) or Answer())
    assert main(command[1:]) == 0
    (url, headers, timeout), = asked  # fmt: skip
    assert urlsplit(url).path in get_routes(routes) and urlsplit(url).path == "/ready"
    assert urlsplit(url).port == container["ports"][0]["containerPort"]
    assert headers == {"Authorization": f"Bearer {KEY}"}
    assert container["readinessProbe"]["timeoutSeconds"] > timeout


def test_the_grace_period_covers_the_servers_drain(pod, container):
    pause = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pause[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] >= float(pause[1]) + drain_s(), (
        f"preStop {pause[1]} s + the drain {drain_s()} s must fit the grace period"
    )


def test_the_services_and_the_budget_select_the_pods(k8s, container):
    sts = k8s["StatefulSet/h3serve"]["spec"]
    labels = sts["template"]["metadata"]["labels"]
    assert sts["selector"]["matchLabels"].items() <= labels.items()
    assert sts["serviceName"] == "h3serve-pods" and k8s["Service/h3serve-pods"]["spec"]["clusterIP"] == "None"
    for key in ("Service/h3serve", "Service/h3serve-pods"):
        spec = k8s[key]["spec"]
        assert spec["selector"].items() <= labels.items(), key
        assert [p["targetPort"] for p in spec["ports"]] == [container["ports"][0]["name"]], key
    pdb = k8s["PodDisruptionBudget/h3serve"]["spec"]
    assert pdb["selector"]["matchLabels"].items() <= labels.items() and pdb["maxUnavailable"] == 1
    assert sts["replicas"] >= 2, "a fleet: one pod may be disrupted while another serves"
