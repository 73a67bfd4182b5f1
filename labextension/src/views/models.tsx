/** Models: name, size, digest, state; register one from a local path or download one from the
 * hub (POST /models), its progress shown live (`registrations.tsx`). */

import * as React from 'react';

import { shortDigest, size } from '../format';
import type { SidebarModel } from '../model';
import { Button, Empty, Section, StateBadge } from './common';
import { RegistrationsView } from './registrations';

function RegisterForm(props: { model: SidebarModel }): React.ReactElement {
  const [path, setPath] = React.useState('');
  const busy = props.model.busy.has('register');
  const submit = (): void => {
    void props.model.registerModel(path).then(ok => {
      if (ok) {
        setPath('');
      }
    });
  };
  return (
    <form
      className="jp-LMSP-register"
      onSubmit={event => {
        event.preventDefault();
        submit();
      }}
    >
      <input
        className="jp-LMSP-input"
        name="source"
        type="text"
        placeholder="/path/to/model (MLX folder or .gguf) or hf://org/name"
        aria-label="Model path or hub source"
        value={path}
        onChange={event => setPath(event.target.value)}
      />
      <Button name="register" label="Register" disabled={busy} onClick={submit} />
    </form>
  );
}

export function ModelsView(props: { model: SidebarModel }): React.ReactElement {
  const { data, error, loaded } = props.model.models;
  const defaultModel = props.model.service.data?.default_model ?? null;
  return (
    <Section title="Models" name="models" count={data.length} error={error}>
      {data.length ? (
        <ul className="jp-LMSP-list">
          {data.map(m => (
            <li key={m.id} className="jp-LMSP-row jp-LMSP-modelRow" data-model-id={m.id}>
              <div className="jp-LMSP-line">
                <span className="jp-LMSP-name" title={m.path ?? m.id}>
                  {m.id}
                </span>
                {m.id === defaultModel ? <span className="jp-LMSP-tag">default</span> : null}
                <span className="jp-LMSP-grow" />
                <StateBadge state={m.state} />
              </div>
              <div className="jp-LMSP-line jp-LMSP-sub">
                <span className="jp-LMSP-size">{size(m.size_bytes)}</span>
                {m.format ? <span>{m.format}</span> : null}
                <span className="jp-LMSP-digest" title={m.digest ?? 'no digest'}>
                  {shortDigest(m.digest)}
                </span>
              </div>
            </li>
          ))}
        </ul>
      ) : loaded ? (
        <Empty text="No models." />
      ) : null}
      <RegistrationsView model={props.model} />
      <RegisterForm model={props.model} />
    </Section>
  );
}
