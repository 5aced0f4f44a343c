"""Configuration: the shipped files load; bad ones fail with the key path and the problem."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml

from router.config import ConfigError, RouterConfig, load_config, parse_config
from router.index.pool import pool_names
from scorers.policy_config import builtin_policies
from scorers.registry import SCORERS

ROOT = Path(__file__).resolve().parents[2]
VALID = {
    "models": [{"name": "tiny-llama"}],
    "instances": [
        {"name": "a", "url": "http://127.0.0.1:8101"},
        {"name": "b", "url": "http://127.0.0.1:8102/"},
    ],
}


def test_local_fleet_config_matches_the_fleets_defaults() -> None:
    config = load_config(ROOT / "configs" / "local-fleet.yaml")
    assert [i.name for i in config.instances] == ["fleet-0", "fleet-1", "fleet-2"]
    assert [i.url for i in config.instances] == [f"http://127.0.0.1:{8101 + i}" for i in range(3)]
    assert [i.events for i in config.instances] == [f"tcp://127.0.0.1:{5601 + i}" for i in range(3)]
    assert [i.replay for i in config.instances] == [f"tcp://127.0.0.1:{5701 + i}" for i in range(3)]
    assert config.block_size == 32
    assert config.default_policy == "kvroute"
    assert config.policies == builtin_policies()  # the quick start runs the shipped default policy


def test_defaults_are_filled_in() -> None:
    config = parse_config(VALID)
    assert config.instances[1].url == "http://127.0.0.1:8102"
    assert set(config.policies) == {"round-robin", "least-loaded", "precise-prefix", "token-cost", "kvroute"}
    assert config.default_policy == "kvroute"
    assert config.models_of(config.instances[0]) == ["tiny-llama"]
    assert config.upstream.attempts == 2


def test_an_adapter_takes_its_bases_tokenizer_and_pool_name_unless_it_has_its_own() -> None:
    """vLLM tokenizes for a LoRA adapter with the base's tokenizer unless the adapter ships one, and names
    Mooncake keys by the engine's --model, the base, whatever the adapter."""
    config = parse_config(
        _with(
            models=[
                {"name": "llama", "tokenizer": "/models/llama", "pool_name": "Llama-3.1-8B"},
                {"name": "sql", "lora_of": "llama"},
                {"name": "chat", "lora_of": "llama", "tokenizer": "/adapters/chat"},
                {"name": "unlisted-base", "lora_of": "qwen"},
            ]
        )
    )
    tokenizers = {m.name: m.tokenizer for m in config.models}
    assert tokenizers == {
        "llama": "/models/llama",
        "sql": "/models/llama",
        "chat": "/adapters/chat",
        "unlisted-base": None,  # its base's own, found at start (router/upstreams/model_tokenizers.py)
    }
    assert pool_names(config.models) == {
        "llama": "Llama-3.1-8B",
        "sql": "Llama-3.1-8B",
        "chat": "Llama-3.1-8B",
        "unlisted-base": "qwen",
    }
    plain = parse_config(_with(models=[{"name": "llama"}, {"name": "sql", "lora_of": "llama"}]))
    assert pool_names(plain.models) == {"llama": "llama", "sql": "llama"}
    nulls = parse_config(
        _with(
            models=[
                {"name": "llama", "tokenizer": "/models/llama", "pool_name": "L-8B"},
                {"name": "sql", "lora_of": "llama", "tokenizer": None, "pool_name": None},
            ]
        )
    )
    # null: not set
    assert (nulls.models[1].tokenizer, pool_names(nulls.models)["sql"]) == ("/models/llama", "L-8B")


def test_a_model_whose_own_tokenizer_is_not_here_by_its_name_is_warned_of(
    tmp_path: Path, model_dir: Path
) -> None:
    """No model falls back to the test model's tokenizer: one named by a directory here has its own."""
    local = tmp_path / "my-model"
    shutil.copytree(model_dir, local)
    config = parse_config(
        _with(
            models=[
                {"name": str(local)},
                {"name": "my-lora", "lora_of": str(local)},
                {"name": "llama", "tokenizer": "/models/llama"},
                {"name": "sql", "lora_of": "llama"},
                {"name": "tiny-llama"},  # a name, not the builtin
                {"name": "qwen-sql", "lora_of": "tiny-llama"},
                {"name": "remote", "tokenizer": "remote"},
                {"name": "test", "tokenizer": "builtin:tiny-llama"},
            ]
        )
    )
    assert config.models[0].tokenizer is None
    warnings = config.tokenizer_warnings()
    assert [w.split(" ")[0] for w in warnings] == ["models.4", "models.5"]
    assert warnings[1] == (
        "models.5 (qwen-sql) has no tokenizer set, and 'tiny-llama' is neither a tokenizer directory here "
        "nor a model in the local Hugging Face cache: at start the router looks where its instances say "
        "the model is (/v1/models root), else asks their /tokenize for every prompt; set its tokenizer "
        "directory, or `remote`"
    )


def test_an_adapter_takes_its_bases_pool_key_settings_unless_it_has_its_own() -> None:
    """The connector's cache_prefix and store namespace are the engine's, whatever the adapter."""
    config = parse_config(
        _with(
            models=[
                {
                    "name": "llama",
                    "pool_name": "L-8B",
                    "pool_cache_prefix": "team-a",
                    "pool_store_namespace": "@store_pp:1@x",
                },
                {"name": "sql", "lora_of": "llama"},
                {
                    "name": "chat",
                    "lora_of": "llama",
                    "pool_cache_prefix": "team-b",
                    "pool_store_namespace": None,
                },
            ]
        )
    )
    assert pool_names(config.models) == {
        "llama": "team-a@L-8B@store_pp:1@x",
        "sql": "team-a@L-8B@store_pp:1@x",
        "chat": "team-b@L-8B@store_pp:1@x",
    }


def test_an_adapter_takes_its_bases_exclude_tools_option_unless_it_states_its_own() -> None:
    """vLLM's --exclude-tools-when-tool-choice-none is the engine's: an adapter served there renders as its base."""
    config = parse_config(
        _with(
            models=[
                {"name": "llama", "exclude_tools_when_tool_choice_none": True},
                {"name": "sql", "lora_of": "llama"},
                {"name": "chat", "lora_of": "llama", "exclude_tools_when_tool_choice_none": False},
            ]
        )
    )
    assert [m.exclude_tools_when_tool_choice_none for m in config.models] == [True, True, False]


def _with(**changes: object) -> dict[str, object]:
    return {**VALID, **changes}


def test_ipv6_addresses_are_bracketed_hosts() -> None:
    config = parse_config(
        _with(
            instances=[
                {
                    "name": "a",
                    "url": "http://[::1]:8000/",
                    "events": "tcp://[::1]:5557",
                    "replay": "tcp://[fd00::2]:5567",
                },
                {"name": "b", "url": "https://[2001:db8::7]", "events": "tcp://[::ffff:10.0.0.5]:5557"},
            ],
            pool={"master_url": "http://[::1]:9003"},
        )
    )
    assert [i.url for i in config.instances] == ["http://[::1]:8000", "https://[2001:db8::7]"]
    assert [(i.events, i.replay) for i in config.instances] == [
        ("tcp://[::1]:5557", "tcp://[fd00::2]:5567"),
        ("tcp://[::ffff:10.0.0.5]:5557", None),
    ]
    assert config.pool.master_url == "http://[::1]:9003"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (_with(colour="blue"), "  colour: Extra inputs are not permitted"),
        (_with(models=[]), "  models: List should have at least 1 item after validation, not 0"),
        (
            _with(models=[{"name": "m", "pool_store_namespace": "store_tp:4"}]),
            "  models.0.pool_store_namespace: String should match pattern '^@\\S+$'",
        ),
        ({"models": [{"name": "m"}]}, "  instances: Field required"),
        (
            _with(instances=[{"name": "a", "url": "ftp://x"}]),
            "  instances.0.url: 'ftp://x' is not an http(s)://host[:port] URL",
        ),
        (
            _with(instances=[{"name": "a", "url": "http://h:1", "events": "udp://h:5"}]),
            "  instances.0.events: 'udp://h:5' is not a ZMQ endpoint such as tcp://127.0.0.1:5557",
        ),
        (
            _with(instances=[{"name": "a b", "url": "http://h:1"}]),
            "  instances.0.name: String should match pattern '^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$'",
        ),
        (
            _with(instances=[{"name": "a", "url": "http://h:1", "port": 3}]),
            "  instances.0.port: Extra inputs are not permitted",
        ),
        (
            _with(instances=[{"name": "a", "url": "http://h:1"}, {"name": "a", "url": "http://h:2"}]),
            "  instances.1.name: 'a' is used twice",
        ),
        (
            _with(instances=[{"name": "a", "url": "http://h:1"}, {"name": "b", "url": "http://H:1/"}]),
            "  instances.1.url: 'http://H:1' is used twice",
        ),
        (
            _with(instances=[{"name": "a", "url": "https://h"}, {"name": "b", "url": "https://h:443"}]),
            "  instances.1.url: 'https://h:443' is used twice",
        ),
        (
            _with(
                instances=[
                    {"name": "a", "url": "http://h:1", "events": "tcp://h:5"},
                    {"name": "b", "url": "http://h:2", "events": "tcp://h:5"},
                ]
            ),
            "  instances.1.events: 'tcp://h:5' is used twice",
        ),
        (
            _with(
                instances=[{"name": "a", "url": "http://h:1", "events": "tcp://h:5", "replay": "tcp://h:5"}]
            ),
            "  instances.0.replay: 'tcp://h:5' is used twice",
        ),
        (
            _with(
                instances=[
                    {"name": "a", "url": "http://h:1", "replay": "ipc:///tmp/r"},
                    {"name": "b", "url": "http://h:2", "replay": "ipc:///tmp/r"},
                ]
            ),
            "  instances.1.replay: 'ipc:///tmp/r' is used twice",
        ),
        (
            _with(instances=[{"name": "a", "url": "http://h:99999"}]),
            "  instances.0.url: 'http://h:99999': port 99999 is not in 1-65535",
        ),
        (
            _with(instances=[{"name": "a", "url": "http://h:0"}]),
            "  instances.0.url: 'http://h:0': port 0 is not in 1-65535",
        ),
        (
            _with(instances=[{"name": "a", "url": "http://h:1", "events": "tcp://h:65536"}]),
            "  instances.0.events: 'tcp://h:65536': port 65536 is not in 1-65535",
        ),
        (
            _with(pool={"master_url": "http://127.0.0.1:90030"}),
            "  pool.master_url: 'http://127.0.0.1:90030': port 90030 is not in 1-65535",
        ),
        (
            _with(instances=[{"name": "a", "url": "http://h:1", "models": ["other"]}]),
            "  instances.0.models: 'other' is not one of models (['tiny-llama'])",
        ),
        (
            _with(policies={"p": {"scorers": [{"type": "magic"}]}}, default_policy="p"),
            f"  policies.p.scorers.0: unknown scorer type 'magic'; known: {', '.join(sorted(SCORERS))}",
        ),
        (
            _with(
                policies={"p": {"scorers": [{"type": "round-robin", "params": {"x": 1}}]}}, default_policy="p"
            ),
            "  policies.p.scorers.0: params.x: Extra inputs are not permitted",
        ),
        (
            _with(policies={"p": {"scorers": [{"type": "round-robin", "weight": -1}]}}, default_policy="p"),
            "  policies.p.scorers.0.weight: Input should be greater than or equal to 0",
        ),
        (
            _with(policies={"p": {"scorers": []}}, default_policy="p"),
            "  policies.p.scorers: List should have at least 1 item after validation, not 0",
        ),
        (
            _with(
                policies={
                    "p": {
                        "scorers": [
                            {"type": "round-robin", "weight": 0},
                            {"type": "inflight-load", "weight": 0.0},
                        ]
                    }
                },
                default_policy="p",
            ),
            "  policies.p.scorers: every weight is 0",
        ),
        (
            _with(
                policies={
                    "p": {"scorers": [{"type": "ttft-cost", "params": {"resolution_s": float("inf")}}]}
                },
                default_policy="p",
            ),
            "  policies.p.scorers.0: params.resolution_s: Input should be a finite number",
        ),
        (
            _with(
                policies={
                    "p": {
                        "scorers": [{"type": "round-robin"}],
                        "picker": {"type": "softmax", "params": {"temperature": 0}},
                    }
                },
                default_policy="p",
            ),
            "  policies.p.picker: params.temperature: Input should be greater than 0",
        ),
        (
            _with(default_policy="fastest"),
            "  default_policy: 'fastest' is not a policy; defined: round-robin, least-loaded, precise-prefix, kvroute, token-cost",
        ),
        (_with(block_size=0), "  block_size: Input should be greater than or equal to 1"),
        (
            _with(upstream={"attempts": "many"}),
            "  upstream.attempts: Input should be a valid integer, unable to parse string as an integer",
        ),
        (
            _with(traffic={"split": {"kvroute": 90, "fastest": 10}}),
            "  traffic.split: 'fastest' is not a policy; defined: round-robin, least-loaded, precise-prefix, kvroute, token-cost",
        ),
        (
            _with(traffic={"split": {"kvroute": 90, "round-robin": -10}}),
            "  traffic.split: weights must be finite numbers >= 0",
        ),
        (
            _with(traffic={"split": {"kvroute": float("inf"), "round-robin": 1}}),
            "  traffic.split.kvroute: Input should be a finite number",
        ),
        (
            _with(traffic={"split": {"kvroute": float("nan")}}),
            "  traffic.split.kvroute: Input should be a finite number",
        ),
        (
            _with(traffic={"split": {"kvroute": 1e308, "round-robin": 1e308}}),
            "  traffic.split: the weights add up to more than a float holds; use smaller ones",
        ),
        (
            _with(
                policies={"p": {"scorers": [{"type": "round-robin", "weight": float("inf")}]}},
                default_policy="p",
            ),
            "  policies.p.scorers.0.weight: Input should be a finite number",
        ),
        (
            _with(traffic={"split": {"kvroute": 0}}),
            "  traffic.split: at least one policy needs a weight above 0",
        ),
        (
            _with(traffic={"split": {"kvroute": "most"}}),
            "  traffic.split.kvroute: Input should be a valid number, unable to parse string as a number",
        ),
        (_with(traffic={"sticky": True}), "  traffic.sticky: Extra inputs are not permitted"),
        (_with(admin={"token": "short"}), "  admin.token: String should have at least 16 characters"),
        (
            _with(pool={"master_url": "127.0.0.1:9003"}),
            "  pool.master_url: '127.0.0.1:9003' is not an http(s)://host[:port] URL",
        ),
        (
            _with(ttft={"prefill_s_per_token": -1}),
            "  ttft.prefill_s_per_token: Input should be greater than or equal to 0",
        ),
        (
            _with(ttft={"decode_s_per_token": float("inf")}),
            "  ttft.decode_s_per_token: Input should be a finite number",
        ),
        (_with(ttft={"memory": float("nan")}), "  ttft.memory: Input should be a finite number"),
        (
            _with(index={"medium_tiers": {"cpu": "disk"}}),
            "  index.medium_tiers.cpu: Input should be 'gpu', 'cpu' or 'pool'",
        ),
        (
            _with(models=[{"name": "sql", "lora_of": "sql"}]),
            "  models.0.lora_of: 'sql' cannot be an adapter of itself",
        ),
        (
            _with(
                models=[
                    {"name": "tiny-llama"},
                    {"name": "a", "lora_of": "tiny-llama"},
                    {"name": "b", "lora_of": "a"},
                ]
            ),
            "  models.2.lora_of: 'a' is an adapter, not a base model",
        ),
        (
            _with(models=[{"name": "a", "lora_of": ["tiny-llama"]}]),
            "  models.0.lora_of: Input should be a valid string",
        ),
        (
            _with(instances=[{"name": "a", "url": "http://::1:8000"}]),
            "  instances.0.url: 'http://::1:8000' is not an http(s)://host[:port] URL",
        ),
        (
            _with(instances=[{"name": "a", "url": "http://[::1:8000"}]),
            "  instances.0.url: 'http://[::1:8000' is not an http(s)://host[:port] URL",
        ),
        (
            _with(instances=[{"name": "a", "url": "http://[fe80::g]:8000"}]),
            "  instances.0.url: 'http://[fe80::g]:8000': [fe80::g] is not an IPv6 address",
        ),
        (
            _with(instances=[{"name": "a", "url": "http://[127.0.0.1]:8000"}]),
            "  instances.0.url: 'http://[127.0.0.1]:8000': [127.0.0.1] is not an IPv6 address",
        ),
        (
            _with(instances=[{"name": "a", "url": "http://[::1]:8000", "events": "tcp://[::1]"}]),
            "  instances.0.events: 'tcp://[::1]' is not a ZMQ endpoint such as tcp://127.0.0.1:5557",
        ),
        (
            _with(instances=[{"name": "a", "url": "http://[::1]:8000", "replay": "tcp://[::x]:5567"}]),
            "  instances.0.replay: 'tcp://[::x]:5567': [::x] is not an IPv6 address",
        ),
        (
            _with(
                instances=[
                    {"name": "a", "url": "http://[::1]:8000"},
                    {"name": "b", "url": "http://[::1]:8000/"},
                ]
            ),
            "  instances.1.url: 'http://[::1]:8000' is used twice",
        ),
        (
            _with(pool={"master_url": "http://[::1]:99999"}),
            "  pool.master_url: 'http://[::1]:99999': port 99999 is not in 1-65535",
        ),
        # a misspelt key: the closest its place takes, wherever it is
        (
            _with(admission={"max_in_flite": 3}),
            "  admission.max_in_flite: Extra inputs are not permitted (did you mean max_in_flight?)",
        ),
        (
            _with(instances=[{"name": "a", "url": "http://h:1", "evnts": "tcp://h:2"}]),
            "  instances.0.evnts: Extra inputs are not permitted (did you mean events?)",
        ),
        (
            _with(
                policies={"p": {"scorers": [{"type": "token-cost", "params": {"decode_weigth": 0.2}}]}},
                default_policy="p",
            ),
            "  policies.p.scorers.0: params.decode_weigth: Extra inputs are not permitted (did you mean decode_weight?)",
        ),
        (
            _with(policies={"p": {"scorers": [{"type": "round-robin"}], "pickr": {}}}, default_policy="p"),
            "  policies.p.pickr: Extra inputs are not permitted (did you mean picker?)",
        ),
    ],
)
def test_invalid_configs_name_the_key_and_the_problem(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(raw, source="bad.yaml")
    lines = str(caught.value).splitlines()
    assert lines[0] == "bad.yaml: invalid configuration"
    assert message in lines[1:]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("models: [", "not valid YAML"),
        ("- just\n- a list\n", "the top level must be a mapping"),
        ("!!python/object/apply:os.system ['true']", "not valid YAML"),  # safe_load refuses to run code
    ],
)
def test_unusable_files(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_a_file_that_is_not_utf8_is_a_config_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("models: [{name: café}]\n".encode("latin-1"))
    with pytest.raises(
        ConfigError, match=f"^{re.escape(str(path))}: not UTF-8 text: invalid continuation byte at byte 19$"
    ):
        load_config(path)


def test_a_key_given_twice_is_an_error_naming_it_and_a_merge_key_may_be_overridden(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("models: [{name: m}]\ntraffic: {split: {a: 1}}\ninstances: []\ntraffic: {}\n")
    with pytest.raises(
        ConfigError, match=r"not valid YAML: the key 'traffic' is given twice in one mapping \(line 4\)"
    ):
        load_config(path)
    path.write_text(
        "models: [{name: m}]\n"
        "x-instance: &base {name: a, url: 'http://127.0.0.1:9000'}\n"
        "instances: [{<<: *base, url: 'http://127.0.0.1:9001'}]\n"
    )
    with pytest.raises(ConfigError, match=r"x-instance"):  # an unknown key, but the merge itself is read
        load_config(path)


@pytest.mark.parametrize(
    ("tokenizer", "message"),
    [
        ("builtin:llama", "unknown builtin tokenizer 'builtin:llama'; known: tiny-llama"),
        ("/nonexistent/tokenizer", "'/nonexistent/tokenizer' is not a directory"),
        (
            "no-such-org/no-such-model",
            "'no-such-org/no-such-model' is neither a tokenizer directory here nor a model in the local "
            "Hugging Face cache (the router does not download)",
        ),
    ],
)
def test_a_tokenizer_serve_could_not_load_is_refused_naming_its_key(tokenizer: str, message: str) -> None:
    config = parse_config(_with(models=[{"name": "m", "tokenizer": tokenizer}]))
    with pytest.raises(ConfigError, match=re.escape(f"router.yaml: models.0.tokenizer: {message}")):
        config.require_tokenizers("router.yaml")
    for fine in ("builtin:tiny-llama", "remote", None):
        parse_config(_with(models=[{"name": "m", "tokenizer": fine}])).require_tokenizers("router.yaml")


def test_a_policy_with_some_weights_at_0_is_valid() -> None:
    config = parse_config(
        _with(
            policies={"p": {"scorers": [{"type": "round-robin", "weight": 0}, {"type": "inflight-load"}]}},
            default_policy="p",
        )
    )
    assert [s.weight for s in config.policies["p"].scorers] == [0.0, 1.0]


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read: No such file or directory"):
        load_config(tmp_path / "absent.yaml")


def test_example_configs_are_valid() -> None:
    checked: set[str] = set()
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        if path.name.startswith("stack-"):  # stack configurations: tests/kvroute/stack/test_config.py
            continue
        if path.name.startswith("envoy-"):  # Envoy's bootstraps: tests/router/epp run Envoy with them
            continue
        checked.add(path.name)
        config = load_config(path)
        assert yaml.safe_load(path.read_text())
        assert config.default_policy in config.policies
        assert set(config.traffic.split or {}) <= set(config.policies)
    assert {"local-fleet.yaml", "ab-rollout.yaml", "pd-fleet.yaml"} <= checked


def test_the_docs_configuration_examples_are_valid_configurations() -> None:
    """Every YAML example in README and docs/ that names a router configuration section validates, put
    beside a model and an instance where it names none (a misspelt key beside it fails too). The chart's
    values and Kubernetes manifests are left to tests/deploy."""
    sections = set(RouterConfig.model_fields)
    helm_values = set(yaml.safe_load((ROOT / "deploy/helm/kvroute/values.yaml").read_text()))
    base = {
        "models": [{"name": "m", "tokenizer": "builtin:tiny-llama"}],
        "instances": [{"name": "i", "url": "http://h:1"}],
    }
    checked = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"```yaml\n(.*?)```", page.read_text(), re.S):
            documents = list(yaml.safe_load_all(block))  # manifests come several to a block
            example = documents[0] if len(documents) == 1 else None
            keys = set(example) if isinstance(example, dict) else set()
            if not keys & sections or (keys <= helm_values and not keys <= sections):
                continue
            assert isinstance(example, dict)
            if "enabled" in (example.get("discovery") or {}):  # the chart's discovery switch
                continue
            parse_config({**base, **example}, source=page.name)
            checked.append(page.name)
    assert {"policies.md", "flow-control.md", "disaggregation.md", "kubernetes.md", "operations.md"} <= set(
        checked
    )
