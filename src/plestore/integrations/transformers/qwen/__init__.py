"""Qwen4Exp (Qwen3.8-Flash-Next): the PLE n-gram tables, one per PLE layer, served by plestore."""
