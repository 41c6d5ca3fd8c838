"""An algorithm from a module outside the package, through the real plugin path: an installed distribution (a
`.dist-info` with entry_points.txt on the Python path) declares it in the "rollout.algorithms" group; a fresh
process finds it, the config accepts its type, the advantages stage uses it, and its source enters the advantages
cache key. A plugin that cannot load fails with an error naming its entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import blake3

ROOT = Path(__file__).resolve().parent.parent

CONSTANT_PLUGIN = '''
"""A user's algorithm, installed as a distribution of its own."""

from typing import Literal

from rollout_lib.algo import Algorithm, AlgoSettings, Group


class ConstantSettings(AlgoSettings):
    type: Literal["constant"] = "constant"
    value: float = 1.0


class Constant(Algorithm):
    """advantage = value on every completion token of a scored sample."""

    type_name = "constant"
    settings_class = ConstantSettings

    def assign(self, group: Group):
        return group.broadcast(group.per_sample(lambda reward: self.settings.value))
'''

USE_IT = '''
import json

import pyarrow as pa

from rollout_lib import wire
from rollout_lib.config import RlConfig
from rollout_lib.plan_checks import validate_config
from rollout_lib.config.loading import read_toml
from rollout_lib.rl.advantages import training_samples
from rollout_lib.identity.sources import algorithm_sources

raw = read_toml("configs/rl-tiny.toml")
raw["algorithm"]["rl"]["envs"][0]["algo"] = {"type": "constant", "value": 2.5}
config = validate_config(RlConfig, raw)
scored = pa.Table.from_pylist([
    {"sample_id": f"w/1#{i}", "example_id": "w/1", "env": "words", "group_index": i, "prompt_ids": [1, 2],
     "completion_ids": [3, 4], "sampling_logprobs": [-0.5, -0.5], "completion_text": "", "answer": None,
     "info": None, "reward": reward, "reward_error": None if reward is not None else "x"}
    for i, reward in enumerate([0.2, None])], schema=wire.ROLLOUTS)
samples, metrics = training_samples(config, scored)
print(json.dumps({"settings": type(config.settings.envs[0].algo).__module__,
                  "advantages": samples.column("advantages").to_pylist(),
                  "sources": algorithm_sources(config)}))
'''


def install(site: Path, distribution: str, module: str, source: str, entry_point: str) -> Path:
    """`module`.py and a `<distribution>-0.1.dist-info` declaring `entry_point`, as pip would leave them."""
    site.mkdir(parents=True, exist_ok=True)
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    info = site / f"{distribution.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[rollout.algorithms]\n{entry_point}\n")
    return site / f"{module}.py"


def run_python(code: str, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_an_entry_point_algorithm_is_a_config_type_and_trains_in_the_advantages_stage(tmp_path):
    module = install(tmp_path / "site", "rollout-constant-algo", "rollout_constant_algo", CONSTANT_PLUGIN,
                     "constant = rollout_constant_algo:Constant")
    done = run_python(USE_IT, tmp_path / "site")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["settings"] == "rollout_constant_algo"
    # The plugin's assign ran: its constant on the scored sample's completion, no rl credit for the missing one.
    assert result["advantages"] == [[0.0, 0.0, 2.5, 2.5], None]
    # Outside the project's code version, its source is keyed by the advantages stage.
    assert result["sources"] == {"algorithm_sources": {
        "rollout_constant_algo": blake3.blake3(module.read_bytes()).hexdigest()}}


def test_a_plugin_that_cannot_load_fails_naming_its_entry_point(tmp_path):
    install(tmp_path / "site", "rollout-broken-algo", "rollout_broken_algo",
            "import not_an_installed_module_xyz\n", "broken = rollout_broken_algo:Broken")
    done = run_python("import rollout_lib.config", tmp_path / "site")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "rollout_lib.algo.plugins.AlgorithmPluginError: algorithm plugin broken = 'rollout_broken_algo:Broken' "
        "(entry point of rollout-broken-algo, group 'rollout.algorithms'): cannot load: ModuleNotFoundError: "
        "No module named 'not_an_installed_module_xyz'")
