"""Calibration of the local machine: the speed probe (`speed`), eager op costs (`ops`), gloo
collectives (`gloo`), the local profile that ties them together (`local`) and GPU matmul
calibration (`gpu`).
"""
