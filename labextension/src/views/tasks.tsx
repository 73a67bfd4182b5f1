/** Tasks, live from their event streams: what each is (the start of its prompt, short id,
 * caller), its outcome in the notebook widgets' words and colours, tokens and time; cancel;
 * open the log; older (finished) tasks page by page. */

import * as React from 'react';

import { age, duration, localTime } from '../format';
import type { ITaskView, SidebarModel } from '../model';
import { registrationText } from '../registration';
import { isTerminal, outcome } from '../taskstate';
import { Button, Empty, Section } from './common';

/** Output tokens (finished response), text so far (followed response), stage and percent
 * (model registration), else the length of its event log. */
function progress(view: ITaskView): string {
  const tokens = view.tokens ?? view.task.output_tokens;
  if (tokens !== null) {
    return tokens === 1 ? '1 token' : `${tokens} tokens`;
  }
  if (view.task.kind === 'response' && view.chars !== null) {
    return `${view.chars} chars`;
  }
  const registration = view.registration;
  if (registration && registration.fraction !== null && !isTerminal(view.task.state)) {
    return `${registration.stage ?? ''} ${registrationText(registration).percent}`.trim();
  }
  return `${view.task.last_sequence_number + 1} events`;
}

/** A caller the clients list does not name: the owner as it is; a paired client no longer
 * listed (revoked) by the end of its id, as the short task id (a full id is cut at the
 * sidebar's width). */
function callerName(owner: string): string {
  return owner.startsWith('client_') ? `client …${owner.slice(-6)}` : owner;
}

function callerTitle(owner: string, name: string | undefined): string {
  if (name !== undefined) {
    return `started by paired client ${name} (${owner})`;
  }
  return owner.startsWith('client_')
    ? `started by paired client ${owner}, no longer paired`
    : `owner ${owner}`;
}

function TaskRow(props: {
  view: ITaskView;
  model: SidebarModel;
  openLog: (taskId: string) => void;
}): React.ReactElement {
  const { task } = props.view;
  const done = isTerminal(task.state);
  const client = props.model.clients.data.find(c => c.id === task.owner);
  const shown = outcome(task);
  const took = (task.finished_at ?? Date.now() / 1000) - task.created_at;
  return (
    <li
      className="jp-LMSP-row jp-LMSP-task"
      data-task-id={task.id}
      data-state={task.state}
      data-mode={props.view.mode}
      data-chars={props.view.chars ?? undefined}
      data-outcome={shown.cls}
    >
      <div className="jp-LMSP-line jp-LMSP-taskHead">
        <span
          className={`jp-LMSP-state jp-LMSP-state-${shown.cls}`}
          data-state={task.state}
          title={task.error?.message ?? shown.word}
        >
          {shown.word}
        </span>
        {props.view.mode === 'stream' ? (
          <span className="jp-LMSP-live" title="following its event stream">
            ●
          </span>
        ) : null}
        {props.view.mode === 'reconnecting' ? (
          <span
            className="jp-LMSP-reconnecting"
            title="the server does not answer; following again from the last event when it does"
          >
            reconnecting
          </span>
        ) : null}
        <span className="jp-LMSP-grow" />
        <code className="jp-LMSP-shortId" title={task.id}>
          {task.id.slice(-6)}
        </code>
        <span className="jp-LMSP-age" title={`started ${localTime(task.created_at)}`}>
          {age(task.created_at)}
        </span>
      </div>
      {task.prompt_excerpt ? (
        <div className="jp-LMSP-excerpt" title={task.prompt_excerpt}>
          {task.prompt_excerpt}
        </div>
      ) : null}
      <div className="jp-LMSP-line jp-LMSP-lineWrap">
        <span className="jp-LMSP-sub jp-LMSP-grow jp-LMSP-wrap">
          <span className="jp-LMSP-taskModel" title={`${task.id} (${task.kind})`}>
            {task.model ?? task.kind}
          </span>
          {' · '}
          <span className="jp-LMSP-progress">{progress(props.view)}</span>
          {' · '}
          <span
            className="jp-LMSP-took"
            title={done ? 'from its creation to its end' : 'since its creation'}
          >
            {duration(took)}
          </span>
          {' · '}
          <span className="jp-LMSP-owner" title={callerTitle(task.owner, client?.name)}>
            {client ? client.name : callerName(task.owner)}
          </span>
        </span>
        <span className="jp-LMSP-actions">
          <Button
            name="open-log"
            label="Log"
            title="Open the task's event log"
            onClick={() => props.openLog(task.id)}
          />
          <Button
            name="cancel"
            label="Cancel"
            kind="warn"
            title="Cancel this task"
            disabled={
              done || task.state === 'cancelling' || props.model.busy.has(`cancel:${task.id}`)
            }
            onClick={() => void props.model.cancel(task.id)}
          />
        </span>
      </div>
    </li>
  );
}

export function TasksView(props: {
  model: SidebarModel;
  openLog: (taskId: string) => void;
}): React.ReactElement {
  const { model } = props;
  const { data, error, loaded } = model.tasks;
  const listed = [...data, ...model.olderTasks];
  const running = listed.filter(v => !isTerminal(v.task.state)).length;
  return (
    <Section
      title="Tasks"
      name="tasks"
      count={running}
      countLabel={`${running} unfinished of the ${listed.length} tasks listed`}
      countText={`${running} unfinished · ${listed.length - running} finished`}
      error={error}
    >
      {listed.length ? (
        <ul className="jp-LMSP-list">
          {listed.map(view => (
            <TaskRow key={view.task.id} view={view} model={model} openLog={props.openLog} />
          ))}
        </ul>
      ) : loaded ? (
        <Empty text="No tasks yet." />
      ) : null}
      {model.moreTasks ? (
        <div className="jp-LMSP-more">
          <Button
            name="older-tasks"
            label="Older tasks"
            title="List the next page of older tasks"
            disabled={model.busy.has('older-tasks')}
            onClick={() => void model.loadOlderTasks()}
          />
        </div>
      ) : null}
    </Section>
  );
}
