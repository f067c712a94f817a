# A configuration file for train.py, exec'd by configurator.py over its globals.
n_embd = 64
learning_rate = 3e-3
