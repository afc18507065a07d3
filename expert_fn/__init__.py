"""moeless.expert_fn"""
