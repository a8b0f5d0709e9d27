"""Lowering: tile padding to hardware tiles, tiled weight layouts, quantisation, NPU/CPU
partitioning and the memory planner. Nothing is implemented here yet (see DESIGN.md).
"""
