// Validate Prometheus Operator objects against the operator's CRD schemas.
// Usage: node validate_crds.mjs PACKAGE_DIR < objects.json   (a JSON array of objects)
// Prints a JSON array, one entry per object: {"kind", "name", "errors": [...]} (empty when valid).
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const packageDir = process.argv[2];
const objects = JSON.parse(readFileSync(0, "utf8"));
const results = [];
for (const object of objects) {
  const [group, version] = String(object.apiVersion).split("/");
  const file = join(packageDir, group, version, `${object.kind}.js`);
  let errors = [];
  try {
    const module = await import(pathToFileURL(file).href);
    new module[object.kind](object).validate();
  } catch (error) {
    errors = error.errors ? error.errors.map((e) => `${e.instancePath || "/"} ${e.message}`) : [String(error)];
  }
  results.push({ kind: object.kind, name: object.metadata?.name, errors });
}
process.stdout.write(JSON.stringify(results));
