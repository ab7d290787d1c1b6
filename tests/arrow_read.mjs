// tests/arrow_read.mjs -- read a `ds4 collect` dataset with the npm apache-arrow package (an
// Arrow implementation independent of ds4's writer), for tests/test_collect.py.
//
//   node tests/arrow_read.mjs ARROW_MODULE_DIR DATASET_DIR OUT_DIR
//
// Reads DATASET_DIR/state.json, opens every listed shard as an IPC stream (tableFromIPC), and
// writes to OUT_DIR, per column, the values of every row of every shard in order, as raw
// little-endian bytes (COLUMN.bin; token_ids.bin), then prints one JSON object: the shards, their
// rows and record batches, and the first shard's schema (fields with their types, nullability and
// metadata, the schema's metadata).
import { readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { pathToFileURL } from 'node:url';

const [modDir, dir, out] = process.argv.slice(2);
const arrow = await import(pathToFileURL(join(modDir, 'node_modules/apache-arrow/Arrow.node.mjs')).href);

const state = JSON.parse(readFileSync(join(dir, 'state.json'), 'utf8'));
const chunks = new Map();           // column -> [Buffer]
const report = { shards: [], schema: null };

// The values a list (of lists) column holds for rows [0, length) of one batch's data.
function leafValues(data) {
  let lo = 0, hi = data.length;
  let d = data;
  lo += d.offset; hi += d.offset;
  while (d.valueOffsets) {          // a List: follow the offsets down
    const o = d.valueOffsets;
    lo = o[lo]; hi = o[hi];
    d = d.children[0];
    lo += d.offset; hi += d.offset;
  }
  if (d.type.listSize !== undefined) {   // a FixedSizeList: rows of listSize
    const n = d.type.listSize;
    lo *= n; hi *= n;
    d = d.children[0];
    lo += d.offset; hi += d.offset;
  }
  return d.values.subarray(lo, hi);
}

for (const f of state._data_files) {
  const bytes = readFileSync(join(dir, f.filename));
  const table = arrow.tableFromIPC(bytes);
  report.shards.push({ file: f.filename, rows: table.numRows, batches: table.batches.length });
  if (!report.schema) {
    report.schema = {
      metadata: Object.fromEntries(table.schema.metadata),
      fields: table.schema.fields.map((fl) => ({
        name: fl.name, type: String(fl.type), nullable: fl.nullable,
        metadata: Object.fromEntries(fl.metadata),
        child: fl.type.children ? fl.type.children.map((c) => ({ name: c.name, type: String(c.type), nullable: c.nullable })) : [],
      })),
    };
  }
  for (const batch of table.batches) {
    for (const fl of table.schema.fields) {
      const col = batch.getChild(fl.name);
      for (const data of col.data) {
        const v = leafValues(data);
        if (!chunks.has(fl.name)) chunks.set(fl.name, []);
        chunks.get(fl.name).push(Buffer.from(v.buffer, v.byteOffset, v.byteLength));
      }
    }
  }
}
for (const [name, parts] of chunks) writeFileSync(join(out, name + '.bin'), Buffer.concat(parts));
console.log(JSON.stringify(report));
