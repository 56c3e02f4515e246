"""What a run leaves and how it ends: its folder's files and their one reader and writer (``folder``), the exit
codes (``exits``), and credentials kept out of logs (``secrets``). Plain Python."""
