"""The extended Kalman filter: one pass over the model's minibatches, iterated, a dense or diagonal Gaussian."""

from pyro_scalable.infer.ekf.engine import EKF, DiagonalEKF
from pyro_scalable.infer.ekf.posterior import EKFPosterior

__all__ = ["EKF", "DiagonalEKF", "EKFPosterior"]
