"""placeholder"""
import json
def write_report(data, out):
    (out / "report.md").write_text(json.dumps(data.get("plans", [])[:1])[:1000])
