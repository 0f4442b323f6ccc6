"""Plots and tables of captured statistics. matplotlib is imported only to draw."""

from callscope.report._plots import plot_grad_norms as plot_grad_norms
from callscope.report._plots import plot_histograms as plot_histograms
from callscope.report._plots import plot_step_statistics as plot_step_statistics
from callscope.report._tables import statistics_table as statistics_table
from callscope.report._tables import write_csv as write_csv

__all__ = [
    "plot_grad_norms",
    "plot_histograms",
    "plot_step_statistics",
    "statistics_table",
    "write_csv",
]
