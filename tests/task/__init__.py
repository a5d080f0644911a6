"""Tests of the shipped task (src/task/): a forker replaces them with their own task's."""
