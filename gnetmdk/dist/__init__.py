"""Distributed helpers: ranks, collectives, deterministic samplers, launch."""
from .comm import all_gather_object, all_reduce, barrier, get_rank, get_world_size, is_dist, is_main_process
from .sampler import GlobalBatchSampler, ShardSampler

__all__ = ["all_gather_object", "all_reduce", "barrier", "get_rank", "get_world_size", "is_dist",
           "is_main_process", "GlobalBatchSampler", "ShardSampler"]
