"""The settings of several hosts (`H3_NNODES`, `H3_NODE_RANK`, `H3_DIST_INIT_ADDR`, the nodes' key), refused with the
setting named and what is allowed before anything loads; the key never echoed; the rendezvous' pieces that need no
second process (the address, the proofs, the model digest, what differs between two nodes). The processes themselves
are tests/test_nodes.py's."""

from __future__ import annotations

import shutil
import socket

import pytest

from e2e_fixtures import write_tiny_checkpoint
from h3serve.checkpoint.folder import resolve_model_folder
from h3serve.parallel import nodes
from h3serve.parallel.plan import split_address
from h3serve.settings import EngineSettings, SettingsError, load_settings

KEY = "0123456789abcdef" * 3
NODES = {"H3_NNODES": "2", "H3_DIST_INIT_ADDR": "127.0.0.1:29500", "H3_NODE_KEY": KEY, "H3_DEVICE": "cpu"}


def refused(env: dict[str, str]) -> str:
    with pytest.raises(SettingsError) as err:
        load_settings(env=env, check_profile=False)
    assert KEY not in str(err.value)
    return str(err.value)


def test_two_nodes_load_and_the_ranks_are_nodes_times_gpus():
    s = load_settings(env={**NODES, "H3_NUM_GPUS": "2"}, check_profile=False)
    assert (s.nnodes, s.node_rank, s.ranks, s.node_secret) == (2, 0, 4, KEY.encode())
    assert s.resolved(resolve_device=False)["node_key"] == "<redacted>"


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"H3_DIST_INIT_ADDR": None}, "H3_DIST_INIT_ADDR (--dist-init-addr): required with H3_NNODES=2"),
        ({"H3_NODE_KEY": None}, "H3_NODE_KEY: required with H3_NNODES=2"),
        ({"H3_NODE_KEY": "short"}, "H3_NODE_KEY: the key must be 32 or more characters of [A-Za-z0-9._~-] (got 5"),
        ({"H3_NODE_RANK": "2"}, "H3_NODE_RANK (--node-rank): 2: the nodes of H3_NNODES=2 are 0 to 1"),
        ({"H3_DIST_INIT_ADDR": "10.0.0.1"}, "H3_DIST_INIT_ADDR (--dist-init-addr): '10.0.0.1': write HOST:PORT"),
        ({"H3_DIST_INIT_ADDR": "127.0.0.1:65535"}, "the port must be 1 to 65534 (PORT+1 is the process group's store)"),
        ({"H3_DIST_INIT_ADDR": "10.0.0.1:29500"}, "require H3_ALLOW_REMOTE_NODES=true"),
    ],
)
def test_the_node_settings_are_refused_naming_the_setting_and_what_is_allowed(env, needle):
    assert needle in refused({k: v for k, v in {**NODES, **env}.items() if v is not None})


def test_a_remote_address_is_allowed_only_when_asked_for():
    env = {**NODES, "H3_DIST_INIT_ADDR": "10.0.0.1:29500", "H3_ALLOW_REMOTE_NODES": "true"}
    assert load_settings(env=env, check_profile=False).dist_init_addr == "10.0.0.1:29500"


def test_node_settings_on_one_node_are_refused_rather_than_ignored():
    text = refused({"H3_NODE_RANK": "1", "H3_DIST_INIT_ADDR": "127.0.0.1:29500", "H3_NODE_KEY": KEY})
    assert "H3_NODE_RANK (--node-rank): 1: H3_NNODES is 1" in text
    assert "H3_DIST_INIT_ADDR (--dist-init-addr): applies to several nodes; H3_NNODES is 1" in text
    assert "H3_NODE_KEY: applies to several nodes" in text


def test_the_key_one_way_and_a_key_file_readable_by_others_is_refused(tmp_path):
    key = tmp_path / "node.key"
    key.write_text(KEY)
    key.chmod(0o644)
    assert "give the key one way, not both" in refused({**NODES, "H3_NODE_KEY_FILE": str(key)})
    text = refused({**{k: v for k, v in NODES.items() if k != "H3_NODE_KEY"}, "H3_NODE_KEY_FILE": str(key)})
    assert "H3_NODE_KEY_FILE (--node-key-file): the key file" in text and "chmod 600" in text


def test_the_heads_must_divide_by_every_nodes_gpus():
    from h3serve import startup

    # Three nodes are valid settings; the model's heads decide at the start (the tiny DiT's 4 do not divide by 3).
    s = load_settings(env={**NODES, "H3_NNODES": "3"}, check_profile=False, schema=EngineSettings)
    with pytest.raises(ValueError, match=r"H3_NNODES \(--nnodes\): 3 ranks \(3 nodes x 1 GPU\): the DiT's 4 attention"):
        startup.plan(s, "fl2va")


def test_split_address_reads_host_and_port_and_v6():
    assert split_address("192.168.100.1:29500") == ("192.168.100.1", 29500)
    assert split_address("spark-0.local:29500") == ("spark-0.local", 29500)
    with pytest.raises(ValueError, match="IPv6 address is not supported"):
        split_address("[fe80::1]:29500")
    for bad in ("29500", ":29500", "host:", "a b:1", "h:0"):
        with pytest.raises(ValueError):
            split_address(bad)


def test_the_proofs_bind_the_role_the_node_and_both_nonces():
    a = nodes.proof(b"k" * 32, "lead", 1, "n1", "n2")
    assert a == nodes.proof(b"k" * 32, "lead", 1, "n1", "n2")
    others = [nodes.proof(b"k" * 32, "join", 1, "n1", "n2"), nodes.proof(b"k" * 32, "lead", 2, "n1", "n2"),
              nodes.proof(b"k" * 32, "lead", 1, "n3", "n2"), nodes.proof(b"k" * 32, "lead", 1, "n1", "n3"),
              nodes.proof(b"j" * 32, "lead", 1, "n1", "n2")]  # fmt: skip
    assert a not in others and len(set(others)) == len(others)


def test_the_wire_refuses_an_oversized_message():
    left, right = socket.socketpair()
    with left, right:
        left.sendall((nodes.MAX_MESSAGE + 1).to_bytes(4, "big"))
        with pytest.raises(ValueError, match="bytes"):
            nodes.receive(right)
        nodes.send(left, {"beat": True})
        assert nodes.receive(right) == {"beat": True}


def test_the_model_digest_follows_the_configuration_and_index_files(tmp_path):
    release = write_tiny_checkpoint(tmp_path / "a" / "FL2VA")
    copy = shutil.copytree(release, tmp_path / "b" / "FL2VA")
    a, b = (nodes.model_digest(resolve_model_folder(p)) for p in (release, copy))
    assert a == b and len(a) == 64
    config = copy / "vae" / "config.json"
    config.write_text(config.read_text() + " ")
    assert nodes.model_digest(resolve_model_folder(copy)) != a
    assert nodes.model_digest(None) == "built-in tiny model"


def test_what_differs_between_two_nodes_is_named():
    mine = {"model": "a" * 64, "task_type": "fl2va", "gpus per node": "1"}
    assert nodes.differences(mine, dict(mine)) == []
    found = nodes.differences(mine, {**mine, "task_type": "ref2va", "gpus per node": "2"})
    assert found == ["task_type: ref2va on the joining node, fl2va on node 0",
                     "gpus per node: 2 on the joining node, 1 on node 0"]  # fmt: skip
    assert nodes.differences(mine, None) == ["it sent no description of what it runs"]
