"""xstage: measure, model and schedule the X-Stage of device-initiated remote stores."""

__version__ = "0.1.0"
