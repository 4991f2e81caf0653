"""The building blocks a model calls: constrain, matmul, collectives, tensor, attention, experts, ZeRO gathers, stacked layers, offload."""
