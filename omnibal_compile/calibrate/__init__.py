"""Measurements of this machine (links between ranks, pipeline overhead) that calibrate the simulator."""
