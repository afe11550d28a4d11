"""TF_CONFIG checking and strategy selection."""

import json

import pytest

from engine.cluster import distribute
from engine.settings.environment import parse_tf_config
from engine.settings.errors import ConfigError
from engine.settings.fields import Config

GOOD = {"cluster": {"worker": ["host1:2222", "host2:2222"]}, "task": {"type": "worker", "index": 1}}


def test_good_tf_config_parses():
    assert parse_tf_config(json.dumps(GOOD)) == GOOD


@pytest.mark.parametrize(
    "raw,message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        (json.dumps({"task": GOOD["task"]}), "'cluster' must be an object"),
        (json.dumps({**GOOD, "cluster": {"worker": []}}), "cluster['worker'] must be a non-empty list"),
        (json.dumps({**GOOD, "cluster": {"worker": ["host1"]}}), "'host1' is not host:port"),
        (json.dumps({**GOOD, "cluster": {"worker": ["host1:99999"]}}), "'host1:99999' is not host:port"),
        (
            json.dumps({**GOOD, "cluster": {"ps": ["h:1"]}, "task": {"type": "ps", "index": 0}}),
            "no 'worker' or 'chief'",
        ),
        (json.dumps({**GOOD, "task": {"type": "evaluator", "index": 0}}), "task type 'evaluator' is not a job"),
        (json.dumps({**GOOD, "task": {"type": "worker", "index": 2}}), "task index 2 is out of range"),
        (json.dumps({**GOOD, "task": {"type": "worker", "index": "0"}}), "task index '0' is not a whole number"),
        (json.dumps({**GOOD, "cluster": {"worker": ["h:1"], "bogus": ["x:2"]}}), "job 'bogus' in 'cluster' is none of"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "task"}), "'task' must be an object"),
        # Each ended in a traceback (exit 1) or a cluster that never formed (exit 10 after --connect_timeout).
        (json.dumps({**GOOD, "cluster": {"worker": ["h:\u00b2"]}}), "'h:\u00b2' is not host:port"),
        (json.dumps({**GOOD, "cluster": {"worker": ["local host:1"]}}), "'local host:1' is not host:port"),
        (json.dumps({**GOOD, "cluster": {"worker": ["h:1", "h:1"]}}), "the address 'h:1' is listed for more than one"),
        (json.dumps({**GOOD, "rpc_layer": "bogus"}), "rpc_layer 'bogus' is not 'grpc'"),
    ],
)
def test_malformed_tf_config_names_the_field(raw, message):
    with pytest.raises(ConfigError, match="TF_CONFIG=") as error:
        parse_tf_config(raw)
    assert message in str(error.value)


def test_default_strategy_for_the_machine(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert distribute.strategy_name(Config().cluster) == "one_device"
    assert distribute.strategy_name(Config(num_cpu_devices=2).cluster) == "mirrored"
    assert distribute.strategy_name(Config(strategy="tpu", tpu="x").cluster) == "tpu"
    monkeypatch.setenv("TF_CONFIG", json.dumps(GOOD))
    assert distribute.strategy_name(Config().cluster) == "multi_worker"


def test_one_device_is_chief(one_device, mirrored):
    assert distribute.is_chief(one_device) and distribute.is_chief(mirrored)
