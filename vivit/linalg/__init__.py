"""Linear algebra of the GGN through ``G = V Vᵀ`` (ViViT-compatible import path)."""
