from moe_train.model.accounting import ParamCounts, count_params, flops_per_token
from moe_train.model.moe import MoELayer, RoutedExperts
from moe_train.model.router import Router, RouterOutput
from moe_train.model.transformer import Transformer

__all__ = ["Transformer", "MoELayer", "RoutedExperts", "Router", "RouterOutput", "count_params", "flops_per_token", "ParamCounts"]
