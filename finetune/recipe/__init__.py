"""Recipe schema and loading."""

from finetune.recipe.load import load_recipe, load_recipe_text, recipe_to_yaml, validate_recipe
from finetune.recipe.schema import Recipe

__all__ = ["Recipe", "load_recipe", "load_recipe_text", "recipe_to_yaml", "validate_recipe"]
