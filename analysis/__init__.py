"""Tables and figures from run directories under results/ (filled by the analysis issue)."""
