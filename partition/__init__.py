"""Graph partitioning: vertex reordering, 2D chunk grid, on-disk chunk store. Never imports ngra."""
