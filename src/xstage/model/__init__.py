"""Burst-Gap model of the X-Stage: parameters, closed forms, simulator, fitting and profiles."""
