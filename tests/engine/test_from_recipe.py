"""Engine.from_recipe takes a recipe alone (a path, a mapping or a Recipe: it loads the recipe's model) as well as
(model, recipe) (issue 32 item 6)."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import compiledllm
from compiledllm.engine import Engine
from compiledllm.errors import UserError
from compiledllm.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]
RECIPE = {"model": {"path": "tiny-llada2-random"}, "policy": {"name": "threshold", "block_size": 8, "threshold": 0.9},
          "generation": {"max_new_tokens": 8}, "batch_size": 2, "prompts": [{"ids": [3, 4, 5]}]}
PROMPTS = [[3, 4, 5], [6, 7]]


@pytest.fixture
def recipe_file(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(RECIPE))
    return path


def outputs(engine):
    return [r.output_ids for r in engine.generate(PROMPTS)]


def test_a_recipe_alone_loads_its_model(recipe_file):
    model = compiledllm.load_model("tiny-llada2-random")
    given = Engine.from_recipe(model, load_recipe(recipe_file))  # the two-argument form still works
    for source in (recipe_file, str(recipe_file), RECIPE, load_recipe(recipe_file)):
        engine = Engine.from_recipe(source)
        assert engine.config == given.config and engine.max_new_tokens == 8 and engine.block == 8
        assert engine.model.device.type == "cpu"
        assert outputs(engine) == outputs(given)  # the same random model (seeded), the same tokens


def test_overrides_and_a_path_beside_a_model(recipe_file):
    model = compiledllm.load_model("tiny-llada2-random")
    engine = Engine.from_recipe(model, recipe_file, ["generation.max_new_tokens=4"])
    assert engine.model is model and engine.max_new_tokens == 4
    assert Engine.from_recipe(recipe_file, overrides=["batch_size=3"]).config.batch_size == 3


def test_the_quickstart_recipe_path():
    engine = Engine.from_recipe(ROOT / "recipes" / "quickstart.yaml")
    assert engine.max_new_tokens == 64 and engine.model.tokenizer is not None


def test_mistakes_are_one_line_errors(tmp_path):
    model = compiledllm.load_model("tiny-llada2-random")
    with pytest.raises(UserError, match=r"Engine.from_recipe\(model\): give the recipe too"):
        Engine.from_recipe(model)
    with pytest.raises(UserError, match="not found"):
        Engine.from_recipe(tmp_path / "missing.yaml")
    with pytest.raises(UserError, match="parallel"):
        Engine.from_recipe(RECIPE | {"parallel": {"tensor": 2}})
