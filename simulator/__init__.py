"""cuflash IO analyzer (installed as cuflash.simulator)."""
