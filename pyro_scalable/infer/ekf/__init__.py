"""The online diagonal extended Kalman filter: one pass over the model's minibatches, a diagonal Gaussian."""

from pyro_scalable.infer.ekf.engine import DiagonalEKF, EKFPosterior

__all__ = ["DiagonalEKF", "EKFPosterior"]
