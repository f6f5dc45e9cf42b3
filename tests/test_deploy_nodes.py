"""The compose files of two hosts as one (deploy/compose.node0.yaml, deploy/compose.node1.yaml), layered over
deploy/compose.yaml: each fixes its node rank and mounts the nodes' key file read-only where H3_NODE_KEY_FILE points,
names only settings, and interpolates only compose variables that .env.example documents; node 1, which serves no
HTTP, has no healthcheck to fail. The settings a node's .env gives (docs/two-sparks.md) load as they are. No Docker
daemon is needed: the files are parsed."""

from __future__ import annotations

import pytest
import yaml

from h3serve.settings import load_settings
from test_deploy import DEPLOY, H3_NAME, SERVICE, SETTINGS, VAR_REF, env_example, environment, mounts

KEY_TARGET = "/run/secrets/h3serve-node-key"


def override(node: int) -> dict:
    return yaml.safe_load((DEPLOY / f"compose.node{node}.yaml").read_text(encoding="utf-8"))


@pytest.mark.parametrize("node", [0, 1])
def test_each_node_file_fixes_its_rank_and_mounts_the_key_file_read_only(node):
    services = override(node)["services"]
    assert set(services) == {SERVICE}, "the same service as compose.yaml, layered over it"
    service = services[SERVICE]
    passed, fixed = environment(service)
    assert not passed, "the settings pass through compose.yaml's list; the node file only fixes"
    assert fixed == {"H3_NODE_RANK": str(node), "H3_NODE_KEY_FILE": KEY_TARGET}
    mount = mounts(service)[KEY_TARGET]
    assert mount["type"] == "bind" and mount["read_only"] is True
    assert mount["bind"]["create_host_path"] is False  # a missing key file stops compose, not the server later
    assert VAR_REF.fullmatch(mount["source"]).group(1) == "H3SERVE_NODE_KEY_FILE"
    assert VAR_REF.fullmatch(mount["source"]).group(2) == ":?"  # required, with a message


@pytest.mark.parametrize("node", [0, 1])
def test_each_node_file_names_only_settings_and_documented_compose_variables(node):
    text = (DEPLOY / f"compose.node{node}.yaml").read_text(encoding="utf-8")
    assert set(H3_NAME.findall(text)) <= SETTINGS
    live, commented = env_example()
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    for m in VAR_REF.finditer(body):
        assert not m.group(1).startswith("H3_") and m.group(1) in {**live, **commented}, m.group(1)


def test_node_1_has_no_healthcheck_to_fail_and_node_0_keeps_the_services():
    assert override(1)["services"][SERVICE]["healthcheck"] == {"disable": True}
    assert "healthcheck" not in override(0)["services"][SERVICE]  # compose.yaml's: /ready


@pytest.mark.parametrize("node", [0, 1])
def test_the_settings_the_two_spark_page_gives_each_node_load(tmp_path, node):
    key = tmp_path / "node.key"
    key.write_text("0123456789abcdef" * 4)
    key.chmod(0o600)
    env = {"H3_NNODES": "2", "H3_NODE_RANK": str(node), "H3_DIST_INIT_ADDR": "192.168.100.1:29500",
           "H3_ALLOW_REMOTE_NODES": "true", "H3_NODE_KEY_FILE": str(key), "H3_DEVICE": "cpu"}  # fmt: skip
    settings = load_settings(env=env, check_profile=False)
    assert (settings.ranks, settings.node_rank, settings.node_secret) == (2, node, key.read_bytes())
