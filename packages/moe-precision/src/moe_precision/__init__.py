"""moe-precision: number-format recipes for the MoE stack's linear and expert modules."""

from moe_precision.recipe import KNOWN_RECIPES, PLANNED_RECIPES, PrecisionRecipe

__version__ = "0.5.5"

__all__ = ["PrecisionRecipe", "KNOWN_RECIPES", "PLANNED_RECIPES"]
